"""A fresh machine is the test: the README's quick start is what CI runs, and it installs the pinned stack.

.ci/run reads the quick start's commands from README.md (.ci/quickstart.py) and runs them as written, so the two
cannot drift; these tests check the shape of those commands and that constraints.txt pins every dependency.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart() -> list[str]:
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / ".ci" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quickstart_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
        else:
            assert not line.strip() or line.startswith("#"), f"constraints.txt: not a pin: {line!r}"
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"^[A-Za-z0-9_.-]+", req).group(0))


def test_ci_runs_the_readmes_quick_start_as_written():
    code = "\n".join(ln for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
                     if not ln.lstrip().startswith("#"))
    assert "python3 .ci/quickstart.py" in code and 'bash -euo pipefail -c "$cmd"' in code
    assert not re.search(r"\bpip\b|\bpytest\b", code)  # no install or test command of its own beside the README's


def test_the_quick_start_is_two_commands_install_pinned_and_plan_then_test():
    install, test = _quickstart()
    steps = [shlex.split(s) for s in install.split("&&")]
    assert steps[0] == ["pip", "install", "torch==2.13.0"]  # the local CPU wheel first
    pip = steps[1]
    assert pip[:2] == ["pip", "install"] and "-c" in pip and pip[pip.index("-c") + 1] == "constraints.txt"
    extras = re.fullmatch(r"\.\[(.*)\]", pip[pip.index("-e") + 1]).group(1).split(",")
    assert sorted(extras) == sorted(_pyproject()["project"]["optional-dependencies"])  # every extra the suite uses
    assert steps[2][:2] == ["vramplan", "plan"]  # the main job, on an embedded default
    assert test == "python -m pytest -q"


def test_constraints_pin_every_dependency_within_pyprojects_ranges():
    from packaging.requirements import Requirement

    pins = _pins()
    project = _pyproject()["project"]
    reqs = list(project["dependencies"]) + [r for group in project["optional-dependencies"].values() for r in group]
    for text in reqs:
        req = Requirement(text)
        name = _norm(req.name)
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {text}"
    assert pins["torch"] == "2.13.0"  # the wheel on this machine's disk; CI installs it first
