"""The CPU kernel paths follow the hardware profile's record (runtime.cpu_paths): `vramplan run` with a YAML profile
that records a path runs that path, and says so; without a record, the CPU's defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_profile, save_tiny_model, tiny_config
from vramplan.planner.hardware import CPU_DECODE_PATHS
from vramplan.planner.profile_yaml import loads_profile

ROOT = Path(__file__).resolve().parents[1]

torch = pytest.importorskip("torch")

from vramplan.runtime.cpu_paths import (FbgemmInt8Dynamic, default_path, fbgemm_available,  # noqa: E402
                                        recorded_paths, resolve)


def _profile(tmp_path: Path, **paths) -> str:
    d = yaml.safe_load(Path(run_profile()).read_text())
    d["name"] = "paths-" + "-".join(f"{k}-{v}" for k, v in paths.items())
    d["host"].update({f"cpu_decode_{k}_path": v for k, v in paths.items()})
    path = tmp_path / f"{d['name']}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def _run(model: Path, quant: str, profile: str) -> dict:
    r = subprocess.run([sys.executable, "cli.py", "run", "--model", str(model), "--quant", quant, "-c", "64",
                        "--prompt-tokens", "8", "--max-new-tokens", "2", "-H", profile, "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tiny_config("llama"), tmp_path_factory.mktemp("paths") / "llama")


@pytest.mark.parametrize("paths", [{"int8_dynamic": "int_mm", "bf16": "linear"},
                                   pytest.param({"int8_dynamic": "fbgemm", "bf16": "mv"}, marks=pytest.mark.skipif(
                                       not fbgemm_available(), reason="this torch has no fbgemm"))])
def test_a_run_takes_the_paths_its_profile_records(model_dir, tmp_path, paths):
    profile = _profile(tmp_path, **paths)
    assert recorded_paths(loads_profile(Path(profile).read_text()).host) == paths
    notes = " ".join(_run(model_dir, "quanto-w8a8", profile)["notes"])
    for kernel, path in paths.items():
        assert f"{kernel} by {path} (the profile)" in notes


def test_the_loaded_modules_are_the_recorded_paths(tiny_checkpoints):
    from vramplan.planner.quant import SCHEMES
    from vramplan.runtime.load import load_model
    from vramplan.runtime.quantize import Bf16Rows, Int8Dynamic

    kinds = {}
    for bf16 in CPU_DECODE_PATHS["bf16"]:
        model = load_model(tiny_checkpoints["qwen2"], scheme=SCHEMES["bf16"], cpu_paths={"bf16": bf16}).model
        kinds[bf16] = {type(m) for m in model.modules()}
    assert Bf16Rows in kinds["mv"] and Bf16Rows not in kinds["linear"]
    for path in CPU_DECODE_PATHS["int8_dynamic"]:
        if path == "fbgemm" and not fbgemm_available():
            continue
        model = load_model(tiny_checkpoints["qwen2"], scheme=SCHEMES["quanto-w8a8"],
                           cpu_paths={"int8_dynamic": path}).model
        types = {type(m) for m in model.modules()}
        assert (FbgemmInt8Dynamic in types) == (path == "fbgemm") and (Int8Dynamic in types) == (path == "int_mm")


def test_without_a_record_the_cpus_defaults():
    assert recorded_paths(None) == {} and resolve(None) == {k: default_path(k) for k in CPU_DECODE_PATHS}
    assert resolve({"bf16": "linear"})["bf16"] == "linear"
    vnni = __import__("torch").cpu._is_vnni_supported()  # _int_mm where the CPU has int8 dot products
    assert default_path("int8_dynamic") == ("fbgemm" if fbgemm_available() and not vnni else "int_mm")
    with pytest.raises(ValueError):
        default_path("int3")


def test_a_profile_refuses_an_unknown_path(tmp_path):
    from vramplan.planner.errors import ProfileError

    d = yaml.safe_load(Path(run_profile()).read_text())
    d["host"]["cpu_decode_int8_dynamic_path"] = "vnni"
    with pytest.raises(ProfileError, match="cpu_decode_int8_dynamic_path: must be one of int_mm, fbgemm"):
        loads_profile(yaml.safe_dump(d))


def test_the_planner_leaves_w8a8_eager_where_the_profile_runs_it_by_fbgemm():
    """Compiled, fbgemm's packed rows are reached through a custom op at every matmul, and eager was faster: --compile
    is refused with that reason where the profile records fbgemm, and priced where it records _int_mm."""
    from dataclasses import replace

    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen2.5-0.5b")
    req = Request(context=4096, quant=("quanto-w8a8",), kv_dtype=("bf16",), compiled=True)
    by_path = {path: plan(spec, replace(hw, host=replace(hw.host, cpu_decode_int8_dynamic_path=path)), req)
               for path in CPU_DECODE_PATHS["int8_dynamic"]}
    assert by_path["int_mm"].fits and by_path["int_mm"].choice.weight_quant == "quanto-w8a8"
    assert not by_path["fbgemm"].fits and "runs by fbgemm on this CPU" in by_path["fbgemm"].candidates[0].reason
    assert plan(spec, replace(hw, host=replace(hw.host, cpu_decode_int8_dynamic_path="fbgemm")),
                replace(req, compiled=False)).fits


@pytest.mark.skipif(not fbgemm_available(), reason="this torch has no fbgemm")
def test_a_copy_of_packed_rows_is_its_own_and_pickling_says_why_not():
    import copy
    import pickle

    data = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    m = FbgemmInt8Dynamic(data, torch.rand(16).to(torch.bfloat16) / 100, None)
    x = torch.randn(3, 64)
    c = copy.deepcopy(m)
    assert c.key != m.key and torch.equal(c(x), m(x))
    del c  # the copy's packed rows go with it, not the original's
    assert m(x).shape == (3, 16)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(m)
