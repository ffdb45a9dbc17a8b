"""Issue 36's audit of profiles and their caches: the parsed-profile cache deletes only its own entries and trusts only
entries this user wrote for this very text (never a FIFO, a link, another user's or a group-writable file); a cache
directory that cannot be named, a cached probe dated in the future, a file in the current directory named like a
profile, integers too long for Python and YAML 1.1's other spellings of numbers all get a plain answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli_helpers import assert_one_line_error, isolate, run_cli as main
from vramplan.planner.errors import PlanError, ProfileError
from vramplan.planner.plan import load_plan
from vramplan.planner.profile_yaml import load_profile as parse_profile
from vramplan.planner.profiles import name_shadows, shipped_profiles_dir
from vramplan.planner.units import GiB
from vramplan.runtime import this_machine, yaml_cache
from vramplan.runtime.files import CacheDirError, cache_dir

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = shipped_profiles_dir() / "rtx-4090.yaml"
RTX_TEXT = SHIPPED.read_text()
# A `~user` no system has: Path.expanduser raises RuntimeError for it.
NO_SUCH_USER = "~vramplan-no-such-user-q7z"
# A read that would block (a FIFO) fails the test instead of hanging the suite.
HANG_GUARD_S = 60
# Longer than the digits Python converts to an int by default (sys.get_int_max_str_digits(): 4300).
HUGE_INT = "1" * 5000


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def genuine_document() -> dict:
    return yaml.safe_load(RTX_TEXT)


def with_1000_gib(doc: dict) -> dict:
    doc["gpus"][0]["memory"] = "1000 GiB"
    return doc


def plant(document, *, text: str = RTX_TEXT, digest: str | None = None, mode: int = 0o600) -> Path:
    """An entry for `text` written by hand: the genuine format, the text's digest unless `digest`, `mode`."""
    entry = yaml_cache.entry_path(text)
    entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = {"format": yaml_cache.FORMAT, "sha256": digest or yaml_cache.text_digest(text), "document": document}
    entry.write_text(json.dumps(data))
    entry.chmod(mode)
    return entry


def gpu_memory() -> int:
    return yaml_cache.load_profile(SHIPPED).gpu.memory_bytes


# ---------------------------------------------------------------- 1. pruning deletes only the cache's own entries
def test_pruning_keeps_every_file_the_cache_did_not_write(tmp_path, monkeypatch):
    """$VRAMPLAN_CACHE_DIR pointed at a project: 100 user *.json files (some named like entries) in the very directory
    the entries go to survive more than MAX_ENTRIES cache writes; the cache's own entries are pruned to MAX_ENTRIES."""
    project = tmp_path / "project"
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(project))
    entries_dir = project / yaml_cache.ENTRY_DIR
    entries_dir.mkdir(parents=True, mode=0o700)
    users = {entries_dir / f"data-{i:03}.json": json.dumps({"i": i}) for i in range(97)}
    lookalike = f"{yaml_cache.ENTRY_PREFIX}{'ab' * 32}{yaml_cache.ENTRY_SUFFIX}"  # the name's pattern, not our content
    users[entries_dir / lookalike] = json.dumps({"format": yaml_cache.FORMAT, "mine": True})
    users[entries_dir / "vramplan-profile-notes.json"] = "{}"
    users[entries_dir / f"{'cd' * 32}.json"] = json.dumps({"format": 1, "document": {}})  # the first format's name
    for path, text in users.items():
        path.write_text(text)
        os.utime(path, (1e9, 1e9))  # older than any entry: the first to go if pruning looked at them
    assert len(users) == 100
    writes = yaml_cache.MAX_ENTRIES + 6
    start = time.time() - 2 * writes  # entries a second apart, all before the next one's write (file times can tie)
    for i in range(writes):
        source = tmp_path / f"p{i}.yaml"
        source.write_text(RTX_TEXT.replace("name: rtx-4090", f"name: p{i}"))
        yaml_cache.load_profile(source)
        os.utime(yaml_cache.entry_path(source.read_text()), (start + i, start + i))
    assert {p: p.read_text() for p in users} == users
    ours = [p for p in entries_dir.iterdir() if p not in users]
    assert len(ours) == yaml_cache.MAX_ENTRIES
    kept = {json.loads(p.read_text())["document"]["name"] for p in ours}
    assert kept == {f"p{i}" for i in range(writes - yaml_cache.MAX_ENTRIES, writes)}


def test_entries_are_named_recognisably_and_private(tmp_path):
    parse = yaml_cache.load_profile(SHIPPED)
    entry = yaml_cache.entry_path(RTX_TEXT)
    assert entry.name == f"vramplan-profile-{yaml_cache.text_digest(RTX_TEXT)}.json" and len(entry.stem) == 17 + 64
    assert entry.stat().st_mode & 0o777 == 0o600 and entry.parent.stat().st_mode & 0o777 == 0o700
    data = json.loads(entry.read_text())
    assert data["sha256"] == yaml_cache.text_digest(RTX_TEXT) and parse == parse_profile(SHIPPED)


# ---------------------------------------------------------------- 2. an entry is trusted only when it is this text's
def test_a_private_entry_with_the_texts_digest_is_used():
    """The control for the refusals below: a hand-written entry that passes every check is what the cache returns
    (so a refused one is refused by a check, not by a mistake in how these tests plant it)."""
    plant(with_1000_gib(genuine_document()))
    assert gpu_memory() == 1000 * GiB


def test_an_entry_with_another_digest_is_refused_and_replaced():
    entry = plant(with_1000_gib(genuine_document()), digest="0" * 64)
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes
    assert json.loads(entry.read_text())["document"] == genuine_document()  # replaced by a fresh parse


def test_an_entry_of_another_text_copied_to_this_name_is_refused():
    other = RTX_TEXT.replace("name: rtx-4090", "name: other")
    planted = with_1000_gib(genuine_document())
    entry = plant(planted)
    entry.write_text(json.dumps({"format": yaml_cache.FORMAT, "sha256": yaml_cache.text_digest(other),
                                 "document": planted}))
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes


@pytest.mark.parametrize("content", [
    "{}",
    json.dumps({"format": 2, "sha256": yaml_cache.text_digest(RTX_TEXT), "document": {}}),
    json.dumps({"format": 2, "sha256": yaml_cache.text_digest(RTX_TEXT)}),
    json.dumps({"format": 2, "sha256": yaml_cache.text_digest(RTX_TEXT), "document": {"schema_version": 99}}),
    "[1, 2]",
    "{not json",
])
def test_an_entry_that_is_no_valid_profile_is_parsed_again_and_no_error_blames_the_file(content):
    entry = plant(None)
    entry.write_text(content)
    assert yaml_cache.load_profile(SHIPPED) == parse_profile(SHIPPED)
    assert json.loads(entry.read_text())["document"] == genuine_document()


def test_the_cli_plans_with_the_file_not_a_planted_entry(capsys):
    """The audit's case: a planted rtx-4090 entry of 1000 GiB (another digest) made a 405B fit."""
    argv = ("plan", "--model", "llama-3.1-405b", "-H", "rtx-4090", "--json")
    clean = main(capsys, *argv)
    plant(with_1000_gib(genuine_document()), digest="f" * 64)
    assert main(capsys, *argv) == clean
    assert clean[0] == 1  # nothing fits a 24 GiB card and the profile's RAM


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_an_entry_others_may_write_is_refused(mode):
    entry = plant(with_1000_gib(genuine_document()), mode=mode)
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes
    assert entry.stat().st_mode & 0o777 == 0o600  # replaced by a private one


def test_a_directory_others_may_write_is_neither_read_nor_written():
    entry = plant(with_1000_gib(genuine_document()))
    entry.parent.chmod(0o770)
    planted = entry.read_text()
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes
    assert entry.read_text() == planted


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file away needs root")
@pytest.mark.parametrize("what", ["entry", "directory"])
def test_an_entry_or_directory_of_another_user_is_refused(what):
    entry = plant(with_1000_gib(genuine_document()))
    os.chown(entry if what == "entry" else entry.parent, 65534, 65534)
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes


# ---------------------------------------------------------------- 3. a FIFO, a link: passed over without waiting
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_at_an_entry_neither_hangs_nor_fails_a_plan(tmp_path):
    entry = yaml_cache.entry_path(RTX_TEXT)
    entry.parent.mkdir(parents=True, mode=0o700)
    os.mkfifo(entry, 0o600)
    r = subprocess.run([sys.executable, "cli.py", "profiles", "show", "rtx-4090", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["profile"]["name"] == "rtx-4090"
    assert entry.is_file() and not entry.is_symlink()  # replaced by a regular entry


def test_a_symlink_at_an_entry_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": yaml_cache.FORMAT, "sha256": yaml_cache.text_digest(RTX_TEXT),
                                  "document": with_1000_gib(genuine_document())}))
    target.chmod(0o600)
    entry = yaml_cache.entry_path(RTX_TEXT)
    entry.parent.mkdir(parents=True, mode=0o700)
    entry.symlink_to(target)
    assert gpu_memory() == parse_profile(SHIPPED).gpu.memory_bytes
    assert not entry.is_symlink() and "1000 GiB" in target.read_text()  # the link replaced, its target untouched


# ---------------------------------------------------------------- 4. a cache directory that cannot be named
def test_a_cache_dir_of_no_user_plans_without_a_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", f"{NO_SUCH_USER}/x")
    code, out, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", "--json")
    assert code == 0, err
    assert "internal error" not in err and json.loads(out)
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())  # nothing made under a literal "~user"


def test_this_machine_with_a_cache_dir_of_no_user_says_it_was_not_cached(capsys, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", f"{NO_SUCH_USER}/x")
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-c", "1k", "--json")
    assert code == 0, err
    assert f"not cached: $VRAMPLAN_CACHE_DIR='{NO_SUCH_USER}/x': cannot expand '{NO_SUCH_USER}'" in " ".join(
        err.split()), err


@pytest.mark.parametrize("var", ["VRAMPLAN_CACHE_DIR", "XDG_CACHE_HOME"])
def test_cache_dir_of_no_user_is_a_one_line_error(monkeypatch, var):
    monkeypatch.delenv("VRAMPLAN_CACHE_DIR")
    monkeypatch.setenv(var, f"{NO_SUCH_USER}/c")
    with pytest.raises(CacheDirError, match=f"{var}=.*cannot expand '{NO_SUCH_USER}'"):
        cache_dir()


@pytest.mark.parametrize("var", ["VRAMPLAN_CONFIG_DIR", "VRAMPLAN_PROFILES", "XDG_CONFIG_HOME"])
def test_a_profile_directory_of_no_user_is_a_one_line_error(capsys, monkeypatch, var):
    monkeypatch.delenv("VRAMPLAN_CONFIG_DIR")
    monkeypatch.setenv(var, f"{NO_SUCH_USER}/p")
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090")
    assert f"cannot expand '{NO_SUCH_USER}'" in assert_one_line_error(code, err)


# ---------------------------------------------------------------- 5. a cached probe dated in the future expires
def cache_an_idle_probe() -> Path:
    profile = this_machine.this_machine(refresh=True).profile
    idle = tuple(n for n in profile.notes if not n.startswith(this_machine.BUSY_NOTE_PREFIX))
    path = this_machine.store(profile.replace(notes=idle))
    assert path is not None
    return path


def test_a_cached_probe_dated_in_the_future_is_measured_again():
    path = cache_an_idle_probe()
    two_days_ahead = time.time() + 2 * this_machine.SECONDS_PER_DAY
    os.utime(path, (two_days_ahead, two_days_ahead))
    here = this_machine.this_machine()
    assert here.probed_now and "dated 2.0 days in the future" in here.why_probed
    assert path.stat().st_mtime <= time.time()  # the new probe replaced it
    soon = time.time() + this_machine.CLOCK_SKEW_ALLOWANCE_S / 2  # a clock skew within the allowance: used
    os.utime(path, (soon, soon))
    assert not this_machine.this_machine().probed_now


# ---------------------------------------------------------------- 6. a file here named like a profile
def test_a_bare_profile_name_is_the_profile_even_with_a_file_of_that_name_here(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rtx-4090").write_text((shipped_profiles_dir() / "l4.yaml").read_text())
    code, out, err = main(capsys, "profiles", "show", "rtx-4090", "--json")
    assert code == 0, err
    assert json.loads(out)["path"] == str(SHIPPED)
    assert f"it shadows {tmp_path / 'rtx-4090'} (the current directory; `./rtx-4090` reads it)" in " ".join(
        err.split()), err
    code, out, err = main(capsys, "profiles", "show", "./rtx-4090", "--json")
    assert code == 0 and json.loads(out)["profile"]["name"] == "l4" and "shadows" not in err
    assert name_shadows("rtx-4090") == [(tmp_path / "rtx-4090", "the current directory; `./rtx-4090` reads it")]
    assert name_shadows("./rtx-4090") == []


def test_a_bare_name_no_profile_has_still_reads_the_file_here(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-rig").write_text((shipped_profiles_dir() / "l4.yaml").read_text())
    code, out, err = main(capsys, "profiles", "show", "my-rig", "--json")
    assert code == 0 and json.loads(out)["profile"]["name"] == "l4" and "shadows" not in err
    assert name_shadows("my-rig") == []


# ---------------------------------------------------------------- 7. integers longer than Python converts
def huge_count_profile(tmp_path: Path) -> Path:
    bad = tmp_path / "huge.yaml"
    bad.write_text(RTX_TEXT.replace("  count: 1\n", f"  count: {HUGE_INT}\n", 1))
    assert bad.read_text() != RTX_TEXT
    return bad


def test_a_profile_with_an_integer_too_long_for_python_is_one_line(capsys, tmp_path):
    bad = huge_count_profile(tmp_path)
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", bad)
    line = assert_one_line_error(code, err)
    assert f"{bad}: " in line and "an integer of 5000 digits" in line and len(line) < 300
    code, _, err = main(capsys, "profiles", "validate", bad)
    assert code == 1 and "an integer of 5000 digits" in err and "internal error" not in err


def test_profiles_list_shows_a_file_with_a_huge_integer_as_invalid_and_lists_the_rest(capsys, monkeypatch, tmp_path):
    team = tmp_path / "team"
    team.mkdir()
    huge_count_profile(team)
    (team / "good.yaml").write_text(RTX_TEXT)
    monkeypatch.setenv("VRAMPLAN_PROFILES", str(team))
    code, out, err = main(capsys, "profiles", "list", "--json")
    assert code == 0, err
    by_name = {e["name"]: e for e in json.loads(out)["profiles"]}
    assert not by_name["huge"]["valid"] and "an integer of 5000 digits" in by_name["huge"]["error"]
    assert by_name["good"]["valid"] and by_name["l4"]["valid"]


@pytest.mark.parametrize("old, new, says", [
    ("bandwidth_efficiency: 0.947", f"bandwidth_efficiency: {'9' * 400}", "expected a number, got an integer of 400"),
    ("schema_version: 1", f"schema_version: {'9' * 400}", "unsupported schema version an integer of 400 digits"),
])
def test_an_integer_too_large_for_a_float_is_one_line(tmp_path, old, new, says):
    bad = tmp_path / "big.yaml"
    bad.write_text(RTX_TEXT.replace(old, new, 1))
    assert bad.read_text() != RTX_TEXT
    with pytest.raises(ProfileError, match=says):
        parse_profile(bad)


def test_a_saved_plan_with_an_integer_too_long_for_python_is_a_plan_error(capsys, tmp_path):
    saved = tmp_path / "p.yaml"
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", "cpu-ddr5-desktop", "-c", "1k", "--save",
                        saved)
    assert code == 0, err
    text = saved.read_text()
    assert "  context: 1024\n" in text
    saved.write_text(text.replace("  context: 1024\n", f"  context: {HUGE_INT}\n", 1))
    with pytest.raises(PlanError, match="not valid YAML or JSON"):
        load_plan(saved)


# ---------------------------------------------------------------- 8. YAML 1.1's other spellings of numbers
@pytest.mark.parametrize("spelling", ["1:00", "0x10", "017", "0o17", "1_000", "0b11", "00"])
def test_an_integer_field_takes_plain_decimal_digits_only(capsys, tmp_path, spelling):
    bad = tmp_path / "odd.yaml"
    bad.write_text(RTX_TEXT.replace("  count: 1\n", f"  count: {spelling}\n", 1))
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", bad)
    line = assert_one_line_error(code, err)
    assert f'gpus[0].count: expected an integer, got "{spelling}"' in line, line


@pytest.mark.parametrize("spelling", ["0:50.5", "1_0.5"])
def test_a_number_field_takes_no_base_60_or_underscores(tmp_path, spelling):
    bad = tmp_path / "odd.yaml"
    bad.write_text(RTX_TEXT.replace("bandwidth_efficiency: 0.947", f"bandwidth_efficiency: {spelling}", 1))
    with pytest.raises(ProfileError, match=f'bandwidth_efficiency: expected a number, got "{spelling}"'):
        parse_profile(bad)


def test_an_explicit_int_tag_takes_plain_decimal_digits_only(tmp_path):
    bad = tmp_path / "tagged.yaml"
    bad.write_text(RTX_TEXT.replace("  count: 1\n", "  count: !!int 0x10\n", 1))
    with pytest.raises(ProfileError, match="'0x10' is not a plain decimal integer"):
        parse_profile(bad)
    good = tmp_path / "plain.yaml"
    good.write_text(RTX_TEXT.replace("  count: 1\n", "  count: !!int 2\n", 1))
    assert parse_profile(good).gpus[0].count == 2


def test_a_cached_probe_anyone_may_write_is_probed_again(tmp_path, monkeypatch):
    """This machine's cached quick probe is trusted like a profile-cache entry: this user's, and no one else's to
    write; a group-writable one (a shared cache directory) is measured again, not read."""
    from vramplan.runtime import this_machine

    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    first = this_machine.this_machine()
    assert first.cache_file is not None and this_machine.cached_profile() is not None
    first.cache_file.chmod(0o664)
    assert this_machine.cached_profile() is None
    again = this_machine.this_machine()
    assert again.probed_now and this_machine.cached_profile() is not None
