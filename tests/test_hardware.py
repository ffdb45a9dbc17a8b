"""Hardware profiles: schema, strict YAML loading, round trips, lookup by name, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.planner.errors import ProfileError
from vramplan.planner.hardware import (SCHEMA_VERSION, Calibration, CalibrationEntry, GPUSpec, HardwareProfile,
                                       HostSpec, LinkSpec, Overheads)
from vramplan.planner.profile_yaml import (dumps_profile, format_bandwidth_exact, format_bytes_exact,
                                           format_flops_exact, format_seconds_exact, load_profile, loads_profile,
                                           profile_from_dict, profile_to_dict)
from vramplan.planner.profiles import list_profiles, resolve_profile, shipped_profiles_dir
from vramplan.planner.units import MiB, parse_bandwidth, parse_bytes, parse_flops, parse_seconds
from vramplan.runtime.files import save_profile

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(shipped_profiles_dir().glob("*.yaml"))
REQUIRED_SHIPPED = {
    "rtx-3060-12gb", "rtx-3090", "rtx-4060-ti-16gb", "rtx-4090", "rtx-5090", "a10g", "l4", "l40s",
    "a100-40gb", "a100-80gb-sxm", "h100-sxm", "h100-pcie", "h200",
}


def _gpu_profile(**changes) -> HardwareProfile:
    base = dict(
        schema_version=SCHEMA_VERSION,
        name="test-box",
        description="a test machine",
        source="unit test",
        gpus=(GPUSpec(name="NVIDIA GeForce RTX 4090", memory_bytes=24564 * MiB, memory_bandwidth_bytes_per_s=1008e9,
                      bf16_flops=165.2e12, compute_capability="8.9"),),
        host=HostSpec(ram_bytes=64 * 1024**3, ram_bandwidth_bytes_per_s=70e9, cpu_cores=16, cpu_bf16_flops=2.5e12),
        link=LinkSpec(name="PCIe 4.0 x16", h2d_pinned_bytes_per_s=25e9, h2d_pageable_bytes_per_s=12e9,
                      d2h_pinned_bytes_per_s=25e9, d2h_pageable_bytes_per_s=12e9),
        overheads=Overheads(cuda_context_bytes=500 * MiB, allocator_reserve_bytes=256 * MiB, kernel_launch_s=5e-6),
    )
    base.update(changes)
    return HardwareProfile(**base)


def _calibration() -> Calibration:
    return Calibration(
        measured_at="2025-03-01",
        versions={"torch": "2.5.1", "bitsandbytes": "0.45.0"},
        entries=(
            CalibrationEntry(device="gpu", backend="torch", quant="bf16", bandwidth_efficiency=0.71,
                             compute_efficiency=0.55, per_layer_overhead_s=12e-6, per_token_overhead_s=1.5e-3),
            CalibrationEntry(device="gpu", backend="bnb", quant="bnb-nf4", bandwidth_efficiency=0.33,
                             compute_efficiency=0.2),
        ),
        residuals={"decode_tokens_per_s_median_abs_pct": 4.2},
    )


def _rtx4090_dict() -> dict:
    return yaml.safe_load((shipped_profiles_dir() / "rtx-4090.yaml").read_text())


# ---------------------------------------------------------------- round trips


def test_round_trip_with_calibration_and_measured_floats(tmp_path):
    p = _gpu_profile(
        calibration=_calibration(),
        measured=True,
        notes=("a note", "another: with colon"),
        # measured values are arbitrary floats: they must survive the text form bit for bit
        host=HostSpec(ram_bytes=25276514304, ram_bandwidth_bytes_per_s=28587408994.838238, cpu_cores=2,
                      cpu_bf16_flops=418470737078.1275),
    )
    path = save_profile(p, tmp_path / "box.yaml")
    again = load_profile(path)
    assert again == p
    assert profile_to_dict(again) == profile_to_dict(p)
    assert again.calibration.lookup("gpu", "bnb", "bnb-nf4").bandwidth_efficiency == 0.33
    assert again.calibration.lookup("cpu", "bnb", "bnb-nf4") is None
    assert again.calibration.versions_dict == {"torch": "2.5.1", "bitsandbytes": "0.45.0"}
    hash(again)  # frozen all the way down


def test_shipped_set_is_complete():
    names = {p.stem for p in SHIPPED}
    assert REQUIRED_SHIPPED <= names
    profiles = [load_profile(p) for p in SHIPPED]
    assert sum(1 for p in profiles if not p.gpus) >= 2, "two CPU-only profiles"
    assert sum(1 for p in profiles if p.unified_memory) >= 2, "two Apple silicon profiles"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_profile_validates_and_round_trips(path, tmp_path):
    p = load_profile(path)
    assert p.name == path.stem
    assert p.source.strip() and p.description.strip()
    d = profile_to_dict(p)
    assert d == profile_to_dict(profile_from_dict(yaml.safe_load(path.read_text()), origin=str(path)))
    again = load_profile(save_profile(p, tmp_path / path.name))
    assert again == p
    assert profile_to_dict(again) == d
    if p.gpus and not p.unified_memory:
        assert p.link is not None and "PCIe" in p.link.name
        if p.measured:  # a measured profile names its probe and where its runs are kept
            assert p.source.startswith("measured by vramplan probe") and "bench/results/" in p.description
        else:
            assert "http" in p.source, "datasheet URL in source"
    if not p.gpus:
        assert p.link is None and p.overheads == Overheads.zero()
    if p.unified_memory:
        assert p.link is None and p.gpu_memory_bytes < p.host.ram_bytes


@pytest.mark.parametrize(
    "name, memory, bandwidth, tflops",
    [
        ("rtx-4090", 24564 * MiB, 1008e9, 165.2),
        ("rtx-3090", 24576 * MiB, 936e9, 71),
        ("h100-sxm", 81559 * MiB, 3350e9, 989.5),
        ("h100-pcie", 81559 * MiB, 2000e9, 756),
        ("h200", 143771 * MiB, 4800e9, 989.5),
        ("a100-80gb-sxm", 81920 * MiB, 2039e9, 312),
        ("a100-40gb", 40960 * MiB, 1555e9, 312),
        ("l4", 23034 * MiB, 300e9, 121),
        ("l40s", 46068 * MiB, 864e9, 362.05),
    ],
)
def test_shipped_datasheet_figures(name, memory, bandwidth, tflops):
    p, _ = resolve_profile(name)
    assert p.gpu.memory_bytes == memory
    assert p.gpu.memory_bandwidth_bytes_per_s == bandwidth
    assert p.gpu.bf16_flops == pytest.approx(tflops * 1e12)


# ---------------------------------------------------------------- exact unit formatting


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=1.0, max_value=9e15, allow_nan=False, allow_infinity=False))
def test_rate_formatting_is_exact(x):
    assert parse_bandwidth(format_bandwidth_exact(x)) == x
    assert parse_flops(format_flops_exact(x)) == x


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=100.0, allow_nan=False))
def test_seconds_formatting_is_exact(s):
    assert parse_seconds(format_seconds_exact(s)) == s


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 50))
def test_bytes_formatting_is_exact(n):
    assert parse_bytes(format_bytes_exact(n)) == n


def test_formatting_is_readable():
    assert format_bytes_exact(24564 * MiB) == "24564 MiB"
    assert format_bytes_exact(141 * 10**9) == "141 GB"
    assert format_bandwidth_exact(1008e9) == "1008 GB/s"
    assert format_flops_exact(165.2e12) == "165.2 TFLOPS"
    assert format_seconds_exact(parse_seconds("5 us")) == "5 us"
    assert format_seconds_exact(parse_seconds("1.5 ms")) == "1.5 ms"


# ---------------------------------------------------------------- strict loading: each kind of error


def _set(d, path, value):
    keys = path.split(".")
    for k in keys[:-1]:
        d = d[int(k)] if k.isdigit() else d[k]
    last = keys[-1]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("gpus.0.memory_bandwidth", "fast",
         'gpus[0].memory_bandwidth: expected a bandwidth like "1008 GB/s", got "fast"'),
        ("gpus.0.memory", 24, 'gpus[0].memory: expected a size like "24 GiB"'),
        ("gpus.0.memory", "24", 'gpus[0].memory: expected a size'),
        ("gpus.0.memory", "24 Gb", 'gpus[0].memory: expected a size'),  # bits are refused
        ("gpus.0.bf16_compute", "165", "gpus[0].bf16_compute: expected a compute rate"),
        ("gpus.0.count", "1", "gpus[0].count: expected an integer"),
        ("gpus.0.count", 0, "gpus[0].count: must be at least 1"),
        ("gpus.0.compute_capability", 8.9, "gpus[0].compute_capability: expected a quoted compute capability"),
        ("gpus.0.compute_capability", "sm89", 'gpus[0].compute_capability: expected "major.minor"'),
        ("gpus.0.memroy", "24 GiB", 'gpus[0]: unknown key "memroy"'),
        ("gpus.0.name", _DELETE, 'gpus[0]: missing required key "name"'),
        ("host.cpu_cores", "16", "host.cpu_cores: expected an integer"),
        ("host.ram", _DELETE, 'host: missing required key "ram"'),
        ("host", "big", "host: expected a mapping at host"),
        ("link.h2d_pinned", "25 GB", 'link.h2d_pinned: expected a bandwidth like "1008 GB/s", got "25 GB"'),
        ("link", None, "link: a machine with a discrete GPU needs its host link"),
        ("overheads.kernel_launch", 5, "overheads.kernel_launch: expected a time"),
        ("measured", "yes", "measured: expected true or false"),
        ("notes", "one note", "notes: expected a list of strings"),
        ("gpus", {"name": "x"}, "gpus: expected a list of GPUs"),
        ("extra", 1, 'unknown key "extra"'),
        ("name", "my box", "name: expected letters, digits"),
        ("description", _DELETE, 'missing required key "description"'),
    ],
)
def test_schema_errors_name_file_and_key_path(path, value, expected):
    d = _rtx4090_dict()
    _set(d, path, value)
    with pytest.raises(ProfileError) as e:
        profile_from_dict(d, origin="profiles/x.yaml")
    msg = str(e.value)
    assert msg.startswith("profiles/x.yaml: "), msg
    assert expected in msg, msg


def test_calibration_errors_have_key_paths():
    d = _rtx4090_dict()
    d["calibration"] = {
        "measured_at": "2025-03-01",
        "entries": [{"device": "gpu", "backend": "torch", "quant": "bf16", "bandwidth_efficiency": 70,
                     "compute_efficiency": 0.5}],
    }
    with pytest.raises(ProfileError,
                       match=r"calibration\.entries\[0\]\.bandwidth_efficiency: must be at most 1, got 70"):
        profile_from_dict(d, origin="f.yaml")
    d["calibration"]["entries"][0]["bandwidth_efficiency"] = 0.7
    d["calibration"]["entries"][0]["device"] = "tpu"
    with pytest.raises(ProfileError, match=r"calibration\.entries\[0\]\.device"):
        profile_from_dict(d, origin="f.yaml")
    d["calibration"]["entries"][0]["device"] = "gpu"
    d["calibration"]["measured_at"] = "yesterday"
    with pytest.raises(ProfileError, match=r"calibration\.measured_at: expected an ISO date"):
        profile_from_dict(d, origin="f.yaml")
    d["calibration"]["measured_at"] = "2025-03-01"
    d["calibration"]["versions"] = {"torch": 2.5}
    with pytest.raises(ProfileError, match=r"calibration\.versions\.torch: expected a quoted version string"):
        profile_from_dict(d, origin="f.yaml")
    d["calibration"]["versions"] = {"torch": "2.5"}
    assert profile_from_dict(d).calibration.lookup("gpu", "torch", "bf16").bandwidth_efficiency == 0.7


@pytest.mark.parametrize(
    "text, expected",
    [
        ("schema_version: 2\nname: x\n",
         "f.yaml: schema_version: unsupported schema version 2: this vramplan reads version 1"),
        ("schema_version: '1'\n", "f.yaml: schema_version: expected an integer"),
        ("name: x\n", 'f.yaml: missing required key "schema_version"'),
        ("- a\n- b\n", "f.yaml: expected a mapping at the top level, got a list"),
        ("just text\n", 'f.yaml: expected a mapping at the top level, got "just text"'),
        ("a: [1,\n", "f.yaml: not valid YAML at line"),
        ("", "f.yaml: empty file"),
    ],
)
def test_document_level_errors(text, expected):
    with pytest.raises(ProfileError) as e:
        loads_profile(text, "f.yaml")
    assert expected in str(e.value)


def test_dataclass_validation_raises_value_errors():
    with pytest.raises(ValueError, match="memory_bytes"):
        GPUSpec(name="x", memory_bytes=0, memory_bandwidth_bytes_per_s=1e9, bf16_flops=1e12)
    with pytest.raises(ValueError, match="bf16_flops"):
        GPUSpec(name="x", memory_bytes=1, memory_bandwidth_bytes_per_s=1e9, bf16_flops=float("nan"))
    with pytest.raises(ValueError, match="link"):
        _gpu_profile(gpus=())  # CPU-only with a link
    with pytest.raises(ValueError, match="link"):
        _gpu_profile(unified_memory=True)  # unified with a link
    with pytest.raises(ValueError, match="schema"):
        _gpu_profile(schema_version=2)
    with pytest.raises(ValueError, match="two entries"):
        e = CalibrationEntry(device="cpu", backend="quanto", quant="quanto-int8", bandwidth_efficiency=0.5,
                             compute_efficiency=0.5)
        Calibration(measured_at="2025-01-01", entries=(e, e))
    with pytest.raises(ValueError, match="compute_efficiency"):
        CalibrationEntry(device="cpu", backend="torch", quant="bf16", bandwidth_efficiency=0.5, compute_efficiency=0)


def test_derived_properties():
    p = _gpu_profile(gpus=(
        GPUSpec(name="A", memory_bytes=80 * 1024**3, memory_bandwidth_bytes_per_s=3.35e12, bf16_flops=989.5e12,
                count=2),
    ))
    assert p.has_gpu and p.gpu.name == "A" and p.gpu_count == 2
    assert p.gpu_memory_bytes == 80 * 1024**3
    assert p.total_gpu_memory_bytes == 160 * 1024**3
    assert p.gpu_usable_bytes == 80 * 1024**3 - 500 * MiB - 256 * MiB
    cpu = _gpu_profile(gpus=(), link=None)
    assert cpu.gpu is None and not cpu.has_gpu and cpu.gpu_memory_bytes == 0 and cpu.cpu_only


# ---------------------------------------------------------------- finding profiles by name


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    env_a, env_b, config = tmp_path / "a", tmp_path / "b", tmp_path / "config"
    for d in (env_a, env_b, config / "profiles"):
        d.mkdir(parents=True)
    monkeypatch.setenv("VRAMPLAN_PROFILES", f"{env_a}:{env_b}")
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(config))
    return env_a, env_b, config / "profiles"


def _write_variant(directory: Path, filename: str, name: str, description: str) -> Path:
    d = _rtx4090_dict()
    d["name"], d["description"] = name, description
    path = directory / filename
    path.write_text(yaml.safe_dump(d))
    return path


def test_resolve_by_name_and_shadowing(isolated_dirs):
    env_a, env_b, user = isolated_dirs
    _write_variant(env_b, "team-node.yml", "team-node", "from b")
    _write_variant(user, "team-node.yaml", "team-node", "from user")
    _write_variant(user, "rtx-4090.yaml", "rtx-4090", "user's 4090")
    p, path = resolve_profile("TEAM-NODE")  # case-insensitive, .yml found
    assert (p.description, path.parent) == ("from b", env_b)
    _write_variant(env_a, "Team-Node.yaml", "Team-Node", "from a")
    p, path = resolve_profile("team-node")
    assert (p.description, path.parent) == ("from a", env_a)
    assert resolve_profile("rtx-4090")[0].description == "user's 4090"  # user dir before shipped
    assert resolve_profile("h100-sxm")[1].parent == shipped_profiles_dir()
    entries = {e.name.lower(): e for e in list_profiles()}
    assert entries["team-node"].origin == "$VRAMPLAN_PROFILES" and entries["team-node"].path.parent == env_a
    assert entries["rtx-4090"].origin == "user"
    assert entries["h200"].origin == "shipped"


def test_resolve_path_and_errors(isolated_dirs, tmp_path):
    env_a, _, _ = isolated_dirs
    path = _write_variant(tmp_path, "node.yaml", "node", "by path")
    assert resolve_profile(str(path))[0].description == "by path"
    with pytest.raises(ProfileError, match="no such profile file"):
        resolve_profile(str(tmp_path / "missing.yaml"))
    with pytest.raises(ProfileError) as e:
        resolve_profile("rtx4090")
    msg = str(e.value)
    assert 'unknown hardware profile "rtx4090"' in msg and "rtx-4090" in msg
    assert str(env_a) in msg and str(shipped_profiles_dir()) in msg


def test_list_profiles_reports_invalid_files(isolated_dirs):
    env_a, _, _ = isolated_dirs
    (env_a / "broken.yaml").write_text("schema_version: 1\nname: broken\n")
    entry = next(e for e in list_profiles() if e.name == "broken")
    assert entry.profile is None and 'missing required key "description"' in entry.error


# ---------------------------------------------------------------- CLI


def _cli(*args, tmp_path, env_extra=None):
    import os

    env = dict(os.environ, VRAMPLAN_CONFIG_DIR=str(tmp_path / "config"), VRAMPLAN_PROFILES="", COLUMNS="200")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "cli.py", *args], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_profiles_list_and_show(tmp_path):
    r = _cli("profiles", "list", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    data = {d["name"]: d for d in json.loads(r.stdout)["profiles"]}
    assert REQUIRED_SHIPPED <= set(data)
    assert data["rtx-4090"]["valid"] and data["rtx-4090"]["gpus"][0]["memory_bytes"] == 24564 * MiB
    r = _cli("profiles", "list", tmp_path=tmp_path)
    assert r.returncode == 0 and "h100-sxm" in r.stdout
    r = _cli("profiles", "show", "rtx-4090", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["profile"]["gpus"][0]["memory"] == "24564 MiB" and shown["path"].endswith("rtx-4090.yaml")
    r = _cli("profiles", "show", "cpu-epyc-server", tmp_path=tmp_path)
    assert r.returncode == 0 and "CPU only" in r.stdout
    r = _cli("profiles", "show", "rtx4090", tmp_path=tmp_path)
    assert r.returncode == 2 and "did you mean" in r.stderr and "rtx-4090" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_profiles_validate(tmp_path):
    good = shipped_profiles_dir() / "l4.yaml"
    d = _rtx4090_dict()
    d["gpus"][0]["memory_bandwidth"] = "fast"
    bad1 = tmp_path / "bad1.yaml"
    bad1.write_text(yaml.safe_dump(d))
    bad2 = tmp_path / "bad2.yaml"
    bad2.write_text("schema_version: 9\n")
    r = _cli("profiles", "validate", str(good), tmp_path=tmp_path)
    assert r.returncode == 0 and "ok:" in r.stdout
    r = _cli("profiles", "validate", str(good), str(bad1), str(bad2), tmp_path=tmp_path)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, r.stderr
    assert f'{bad1}: gpus[0].memory_bandwidth: expected a bandwidth like "1008 GB/s", got "fast"' in lines[0]
    assert f"{bad2}: schema_version: unsupported schema version 9" in lines[1]


def test_dumps_profile_has_units_in_strings():
    text = dumps_profile(load_profile(shipped_profiles_dir() / "rtx-4090.yaml"))
    assert "memory: 24564 MiB" in text and "memory_bandwidth: 1008 GB/s" in text and "kernel_launch: 5 us" in text


# ---------------------------------------------------------------- the parsed-YAML cache (runtime.yaml_cache)


def test_yaml_cache_reads_the_second_time_without_parsing(tmp_path, monkeypatch):
    """The same profile, from the cached document, whose checks still run: an edit is a new entry, invalid YAML is
    never cached and fails the same way every time, a corrupt entry is parsed again, and no cache is no error."""
    from vramplan.runtime import yaml_cache

    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "p.yaml"
    path.write_text((shipped_profiles_dir() / "rtx-4090.yaml").read_text())
    first = yaml_cache.load_profile(path)
    assert first == load_profile(path)
    entry = yaml_cache.entry_path(path.read_text())
    assert json.loads(entry.read_text())["format"] == yaml_cache.FORMAT

    def no_parse(*a, **k):
        raise AssertionError("parsed again")

    monkeypatch.setattr(yaml_cache, "parse_profile_text", no_parse)
    assert yaml_cache.load_profile(path) == first
    monkeypatch.undo()
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))

    # an edit: a new digest, parsed, and the profile follows it
    path.write_text(path.read_text().replace("name: rtx-4090", "name: edited"))
    assert yaml_cache.load_profile(path).name == "edited" and yaml_cache.entry_path(path.read_text()) != entry
    # an entry that breaks the profile's checks is still checked (the cache holds documents, not profiles), and one
    # that fails them is passed over and replaced: the file is valid, and no error may blame it
    doc = json.loads(entry.read_text())
    del doc["document"]["gpus"]
    entry.write_text(json.dumps(doc))
    path.write_text((shipped_profiles_dir() / "rtx-4090.yaml").read_text())
    assert yaml_cache.load_profile(path) == first and "gpus" in json.loads(entry.read_text())["document"]
    # a corrupt entry: parsed again and replaced
    entry.write_text("{not json")
    assert yaml_cache.load_profile(path) == first and json.loads(entry.read_text())["document"]["name"] == "rtx-4090"
    # invalid YAML: the planner's own one-line error, every time, and nothing cached
    before = set(entry.parent.iterdir())
    path.write_text("a: [1,\n")
    for _ in range(2):
        with pytest.raises(ProfileError, match="not valid YAML at line"):
            yaml_cache.load_profile(path)
    assert set(entry.parent.iterdir()) == before
    # a cache that cannot be written: the profile still loads
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(blocker))
    path.write_text((shipped_profiles_dir() / "l4.yaml").read_text())
    assert yaml_cache.load_profile(path) == load_profile(path)


def test_yaml_cache_keeps_only_what_json_holds_exactly_and_prunes(tmp_path, monkeypatch):
    import datetime
    import os

    from vramplan.runtime import yaml_cache

    exact = yaml_cache._exact_in_json
    assert exact({"a": [1, 2.5, "x", None, True], "b": {"c": -3}})
    assert not exact({"when": datetime.date(2026, 11, 26)}) and not exact({1: "int key"})
    assert not exact({"x": float("inf")}) and not exact({"x": (1, 2)})
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(yaml_cache, "MAX_ENTRIES", 3)
    src = (shipped_profiles_dir() / "rtx-4090.yaml").read_text()
    for i in range(5):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(src.replace("name: rtx-4090", f"name: p{i}"))
        yaml_cache.load_profile(path)
        os.utime(yaml_cache.entry_path(path.read_text()), (1e9 + i, 1e9 + i))  # file times can tie within a tick
    kept = sorted((tmp_path / yaml_cache.ENTRY_DIR).glob("*.json"))
    assert len(kept) == 3
    assert {json.loads(k.read_text())["document"]["name"] for k in kept} == {"p2", "p3", "p4"}


def test_plan_on_a_named_profile_imports_no_yaml_once_cached(tmp_path):
    """What the cache is for: the second `vramplan plan -H NAME` does not import PyYAML (10 ms of its start-up)."""
    import os

    script = ("import sys\nfrom vramplan.__main__ import console\n"
              "try:\n    console()\nfinally:\n    sys.stderr.write(f'yaml imported: {\"yaml\" in sys.modules}\\n')\n")
    env = dict(os.environ, VRAMPLAN_CACHE_DIR=str(tmp_path), VRAMPLAN_CONFIG_DIR=str(tmp_path / "config"),
               VRAMPLAN_PROFILES="")
    args = ["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--json"]
    runs = [subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert "yaml imported: True" in runs[0].stderr and "yaml imported: False" in runs[1].stderr
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)


def test_yaml_cache_refuses_what_the_planner_refuses_and_needs_no_home(tmp_path, monkeypatch):
    """A review's two finds: a YAML list that holds itself (an alias inside its own anchor) is a one-line
    ProfileError, as without the cache, not a RecursionError; and with no home directory to find a cache in, the
    profile loads all the same."""
    from vramplan.runtime import yaml_cache

    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    looped = tmp_path / "looped.yaml"
    looped.write_text("name: x\nfoo: &a [*a]\n")
    for load in (load_profile, yaml_cache.load_profile, yaml_cache.load_profile):
        with pytest.raises(ProfileError, match='missing required key "schema_version"'):
            load(looped)
    assert not (tmp_path / "cache" / yaml_cache.ENTRY_DIR).exists()
    assert yaml_cache._exact_in_json(yaml.safe_load("foo: &a [*a]\n")) is False

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for var in ("VRAMPLAN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    path = shipped_profiles_dir() / "a10g.yaml"
    assert yaml_cache.load_profile(path) == load_profile(path)
