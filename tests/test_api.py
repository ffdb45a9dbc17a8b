"""The one import namespace and its Python API: `vramplan.plan()` answers what `vramplan plan --json` answers, bad
input raises the errors the command line prints, and `import vramplan` costs nothing until used."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import vramplan
from vramplan.planner.errors import ConfigError, UnitError, VramplanError
from vramplan.planner.constant import Constant
from vramplan.planner.plan import Alternative, HardwareRef, ModelRef, Plan

from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_plan_from_python_is_the_command_lines_plan(capsys):
    p = vramplan.plan("llama-3.1-8b", hardware="rtx-4090", context="32k", vram_budget="20GiB", prefer="speed")
    assert isinstance(p, Plan) and p.fits
    code, out, _ = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "32k",
                           "--vram-budget", "20GiB", "--prefer", "speed", "--json")
    assert code == 0
    cli = json.loads(out)
    assert json.loads(json.dumps(p.to_dict(), default=str)) == cli
    assert p.request.vram_budget_bytes == 20 * 2**30 and p.request.context == 32768
    assert [e.engine for e in p.engines][:2] == ["vramplan", "llama.cpp"] and p.fastest_engine.engine
    # typed at the outer edge, and back from a saved plan's JSON
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict(), default=str)))
    assert again.engines == p.engines and again.fastest_engine == p.fastest_engine
    assert (again.model, again.hardware, again.constants) == (p.model, p.hardware, p.constants)
    assert isinstance(p.model, ModelRef) and isinstance(p.hardware, HardwareRef)
    assert p.hardware.gpu == "NVIDIA GeForce RTX 4090"
    assert all(isinstance(c, Constant) for c in p.constants.values())
    assert p.constants["gpu_capacity_bytes"] == Constant(20 * 2**30, "request --vram-budget")
    # the JSON's keys, in order, as before the records
    d = p.to_dict()
    assert list(d["model"]) == ["id", "source", "inventory", "model_type", "num_layers", "params_total", "fingerprint"]
    assert list(d["hardware"]) == ["name", "source", "gpu", "gpu_memory_bytes", "ram_bytes", "gpus", "measured",
                                   "calibrated", "fingerprint"]
    assert list(d["constants"]["gpu_capacity_bytes"]) == ["value", "from"]


def test_nothing_fits_gives_typed_alternatives_and_a_saved_plans_old_hardware_form_reads_back():
    p = vramplan.plan("llama-3.1-8b", hardware="rtx-3060-12gb", context="128k", batch=16, ram_budget="8GiB")
    assert not p.fits and p.alternatives and all(isinstance(a, Alternative) for a in p.alternatives)
    d = p.to_dict()
    assert d["alternatives"][0] == {"weight_quant": p.alternatives[0].weight_quant,
                                    "kv_dtype": p.alternatives[0].kv_dtype,
                                    "max_context_tokens": p.alternatives[0].max_context_tokens}
    assert Plan.from_dict(d).alternatives == p.alternatives
    # a plan saved before the hardware listed its GPUs: the one GPU comes from "gpu" and "gpu_memory_bytes"
    old = {k: v for k, v in d["hardware"].items() if k != "gpus"}
    assert HardwareRef.from_dict(old).to_dict() == d["hardware"]


def test_typed_inputs_and_forced_options():
    spec, hw = vramplan.model("qwen2.5-0.5b"), vramplan.hardware("rtx-3060-12gb")
    p = vramplan.plan(spec, hw, 4096, quant="bnb-nf4", kv_dtype=("bf16",))
    assert p.model.id == spec.name and p.hardware.name == hw.name
    assert {c.weight_quant for c in p.candidates} == {"bnb-nf4"} and {c.kv_dtype for c in p.candidates} == {"bf16"}
    llama = vramplan.plan(spec, hw, "8k", engine="llama.cpp")
    assert llama.fits and llama.request.engine == "llama.cpp"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(context="32q"), UnitError, "32q"),
    (dict(vram_budget="lots"), UnitError, "lots"),
    (dict(tokens_per_s=3), ConfigError, "tokens_per_s"),
    (dict(quant="int3"), VramplanError, "int3"),
    (dict(hardware="no-such-gpu"), VramplanError, "no-such-gpu"),
])
def test_bad_input_raises_the_command_lines_error(kwargs, error, match):
    kwargs = {"hardware": "rtx-4090", **kwargs}
    with pytest.raises(error, match=match):
        vramplan.plan("llama-3.1-8b", **kwargs)


def test_import_vramplan_is_free_and_the_bare_names_are_not_installed():
    code = ("import sys, vramplan; heavy = {'torch', 'typer', 'rich', 'yaml', 'vramplan.planner'} & set(sys.modules);"
            "print(sorted(heavy))")
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout
    for bare in ("planner", "runtime", "render", "cli"):
        r = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd="/", capture_output=True, text=True)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (bare, r.stderr)


def test_every_package_in_the_repository_is_installed():
    """pyproject lists the packages (package-dir maps the root to `vramplan`): a new subpackage left out of the list
    would be missing from a wheel while an editable install still finds it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"vramplan": "."}
    inits = [p.relative_to(ROOT) for p in ROOT.glob("*/**/__init__.py")]
    here = {"vramplan", *("vramplan." + ".".join(p.parent.parts) for p in inits
                          if not {"tests", "bench", "build", ".git"} & set(p.parts) and ".egg" not in str(p))}
    assert set(config["packages"]) == here
