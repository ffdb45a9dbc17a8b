"""What the CLI tests share: run `cli.main` in-process, check a one-line error, and isolate the environment."""

from __future__ import annotations

import pytest

from vramplan import cli

# Variables a developer's shell may set that would change what a test sees.
USER_VARIABLES = ("VRAMPLAN_PROFILES", "VRAMPLAN_DEBUG", "VRAMPLAN_PROBE_MAX_AGE_DAYS", "VRAMPLAN_HUB_DEADLINE_S")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`vramplan ARGV` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def assert_one_line_error(code: int, err: str, expected: int = 2) -> str:
    """The exit code, no traceback or internal error, exactly one `error:` line; returns that line, whitespace
    normalized."""
    assert code == expected, err
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    return " ".join(errors[0].split())


def isolate(tmp_path, monkeypatch, *, offline_hub: bool = False) -> None:
    """A cache and config directory of the test's own, none of the user's variables; `offline_hub`: no cached hub
    model answers for a catalog name, and the hub is never asked."""
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path / "config"))
    for var in USER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    if offline_hub:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
