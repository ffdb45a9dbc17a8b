"""The prober: NVML parsing with fake answers, CUDA_VISIBLE_DEVICES, cgroups, the probe itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pynvml
import pytest

from vramplan.planner.profile_yaml import dumps_profile, load_profile, loads_profile, profile_from_dict, profile_to_dict
from vramplan.planner.units import GiB, MiB
from vramplan.runtime import probe as probe_mod
from vramplan.runtime.probe import core as probe_core
from vramplan.runtime.probe import (
    HostReading,
    MigDevice,
    NvmlGpu,
    NvmlUnavailable,
    estimate_cpu_flops,
    filter_visible,
    match_datasheet,
    measure_cpu_matmul,
    parse_cgroup_cpu_max,
    parse_cgroup_memory_value,
    parse_cpuinfo,
    parse_nvml_gpu,
    probe,
    read_cgroup_cpu,
    read_cgroup_memory,
    read_host,
    read_nvml,
    typical_link,
)

REPO = Path(__file__).resolve().parent.parent
NOT_SUPPORTED = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _mem(total, free, used):
    return SimpleNamespace(total=total, free=free, used=used)


def _raw_4090(name=b"NVIDIA GeForce RTX 4090", **changes):
    raw = {
        "name": name,
        "uuid": b"GPU-6f2a1c3e-0000-1111-2222-333344445555",
        "pci": SimpleNamespace(busId=b"00000000:01:00.0"),
        "memory": _mem(24564 * MiB, 23000 * MiB, 1564 * MiB),
        "compute_processes": [SimpleNamespace(pid=4242, usedGpuMemory=1024 * MiB),
                              SimpleNamespace(pid=99, usedGpuMemory=300 * MiB)],
        "graphics_processes": [SimpleNamespace(pid=4242, usedGpuMemory=1024 * MiB)],
        "pcie_gen_current": 1,
        "pcie_gen_max": 4,
        "pcie_width_current": 16,
        "pcie_width_max": 16,
        "memory_clock_max": 10501,
        "sm_clock_max": 3105,
        "memory_bus_width": 384,
        "cuda_cores": 16384,
        "compute_capability": (8, 9),
        "mig_mode": NOT_SUPPORTED,
    }
    raw.update(changes)
    return raw


# ---------------------------------------------------------------- NVML parsing


def test_parse_nvml_bytes_and_str_names_agree():
    system = {"driver_version": b"550.54.15", "cuda_driver_version": 12040}
    a = parse_nvml_gpu(0, _raw_4090(), system, own_pid=99)
    b = parse_nvml_gpu(0, _raw_4090(name="NVIDIA GeForce RTX 4090", uuid="GPU-6f2a1c3e-0000-1111-2222-333344445555",
                                     pci=SimpleNamespace(busId="00000000:01:00.0")),
                       {"driver_version": "550.54.15", "cuda_driver_version": 12040}, own_pid=99)
    assert a == b
    assert a.name == "NVIDIA GeForce RTX 4090" and a.uuid.startswith("GPU-6f2a")
    assert a.pci_bus_id == "00000000:01:00.0"
    assert (a.driver_version, a.cuda_driver_version) == ("550.54.15", "12.4")
    assert a.memory_total_bytes == 24564 * MiB and a.memory_free_bytes == 23000 * MiB
    # our own process (pid 99) is not "other"; pid 4242 listed twice counts once
    assert a.other_processes == 1 and a.other_processes_memory_bytes == 1024 * MiB
    assert a.compute_capability == "8.9"
    assert a.mig_enabled is None and a.unreadable == ("mig_mode: not supported",)
    assert a.nvml_peak_bandwidth_bytes_per_s == pytest.approx(1008e9, rel=1e-3)


def test_parse_nvml_not_supported_and_errors():
    raw = _raw_4090(
        pcie_gen_max=NOT_SUPPORTED,
        memory_bus_width=NOT_SUPPORTED,
        memory_clock_max=pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION),
        compute_processes=[SimpleNamespace(pid=7, usedGpuMemory=None)],  # hidden in containers
        graphics_processes=NOT_SUPPORTED,
    )
    g = parse_nvml_gpu(3, raw, {}, own_pid=1)
    assert g.index == 3
    assert g.pcie_gen_max is None and g.memory_bus_width_bits is None and g.memory_clock_max_mhz is None
    assert g.other_processes == 1 and g.other_processes_memory_bytes is None
    assert g.nvml_peak_bandwidth_bytes_per_s is None
    assert "pcie_gen_max: not supported" in g.unreadable and "memory_bus_width: not supported" in g.unreadable
    assert any(u.startswith("memory_clock_max: error") for u in g.unreadable)
    assert g.driver_version is None


def test_parse_nvml_mig_on():
    raw = _raw_4090(
        name=b"NVIDIA A100-SXM4-80GB",
        mig_mode=(1, 1),
        mig_devices=[{"uuid": b"MIG-aaaa-1111", "memory": _mem(19968 * MiB, 19968 * MiB, 0)},
                     {"uuid": "MIG-bbbb-2222", "memory": _mem(9728 * MiB, 9728 * MiB, 0)}],
    )
    g = parse_nvml_gpu(0, raw, own_pid=1)
    assert g.mig_enabled is True
    assert g.mig_devices == (MigDevice("MIG-aaaa-1111", 19968 * MiB), MigDevice("MIG-bbbb-2222", 9728 * MiB))
    off = parse_nvml_gpu(0, _raw_4090(mig_mode=(0, 0)), own_pid=1)
    assert off.mig_enabled is False and off.mig_devices == ()


class FakeNvml:
    """A pynvml stand-in: two GPUs, answers (or errors) from raw dicts."""

    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM

    def __init__(self, raws, init_error=None):
        self.raws, self.init_error, self.shutdown = raws, init_error, False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return len(self.raws)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _answer(self, key, h):
        v = self.raws[h][key]
        if isinstance(v, BaseException):
            raise v
        return v

    def nvmlDeviceGetName(self, h): return self._answer("name", h)
    def nvmlDeviceGetUUID(self, h): return self._answer("uuid", h)
    def nvmlDeviceGetPciInfo(self, h): return self._answer("pci", h)
    def nvmlDeviceGetMemoryInfo(self, h): return self._answer("memory", h)
    def nvmlDeviceGetComputeRunningProcesses(self, h): return self._answer("compute_processes", h)
    def nvmlDeviceGetGraphicsRunningProcesses(self, h): return self._answer("graphics_processes", h)
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return self._answer("pcie_gen_current", h)
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return self._answer("pcie_gen_max", h)
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return self._answer("pcie_width_current", h)
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return self._answer("pcie_width_max", h)
    def nvmlDeviceGetMemoryBusWidth(self, h): return self._answer("memory_bus_width", h)
    def nvmlDeviceGetNumGpuCores(self, h): return self._answer("cuda_cores", h)
    def nvmlDeviceGetCudaComputeCapability(self, h): return self._answer("compute_capability", h)
    def nvmlDeviceGetMigMode(self, h): return self._answer("mig_mode", h)

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return self._answer("memory_clock_max" if clock == self.NVML_CLOCK_MEM else "sm_clock_max", h)


def test_read_nvml_with_fake_library():
    fake = FakeNvml([_raw_4090(), _raw_4090(name=b"NVIDIA L4", uuid=b"GPU-1234", memory_clock_max=NOT_SUPPORTED)])
    gpus = read_nvml(fake, own_pid=99)
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA L4"]
    assert gpus[1].memory_clock_max_mhz is None and "memory_clock_max: not supported" in gpus[1].unreadable
    assert gpus[0].cuda_driver_version == "12.4" and gpus[0].sm_clock_max_mhz == 3105
    assert fake.shutdown
    with pytest.raises(NvmlUnavailable, match="NVML did not start"):
        read_nvml(FakeNvml([], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))


def test_read_nvml_on_this_machine_says_why():
    try:
        gpus = read_nvml()
    except NvmlUnavailable as e:
        assert str(e)
    else:
        assert all(g.name for g in gpus)


# ---------------------------------------------------------------- CUDA_VISIBLE_DEVICES


def _gpus():
    return [
        NvmlGpu(index=0, name="A", uuid="GPU-aaaa-0000", memory_total_bytes=10),
        NvmlGpu(index=1, name="B", uuid="GPU-abbb-1111", memory_total_bytes=20,
                mig_enabled=True, mig_devices=(MigDevice("MIG-cccc-2222", 5),)),
        NvmlGpu(index=2, name="C", uuid="GPU-dddd-3333", memory_total_bytes=30),
    ]


@pytest.mark.parametrize(
    "cvd, names, note",
    [
        (None, ["A", "B", "C"], None),
        ("", [], "empty"),
        ("2,0", ["C", "A"], None),
        (" 1 , 2 ", ["B", "C"], None),
        ("0,7,2", ["A"], "'7' matches no GPU"),
        ("-1", [], "matches no GPU"),
        ("GPU-dddd", ["C"], None),
        ("dddd-3333", ["C"], None),
        ("GPU-a", [], "ambiguous"),
        ("GPU-abbb,0", ["B", "A"], None),
        ("0,0", ["A"], "twice"),
        ("MIG-cccc", ["B MIG"], None),
    ],
)
def test_filter_visible(cvd, names, note):
    visible, notes = filter_visible(_gpus(), cvd)
    assert [g.name for g in visible] == names
    if note:
        assert any(note in n for n in notes), notes
    else:
        assert notes == []


def test_filter_visible_mig_uses_instance_memory():
    (g,), _ = filter_visible(_gpus(), "MIG-cccc-2222")
    assert g.memory_total_bytes == 5 and g.uuid == "MIG-cccc-2222" and g.index == 1


# ---------------------------------------------------------------- cgroups and host


@pytest.mark.parametrize(
    "text, expected",
    [("max\n", None), ("9223372036854771712\n", None), ("8589934592\n", 8 * GiB), ("", None), ("-1", None),
     ("junk", None)],
)
def test_parse_cgroup_memory_value(text, expected):
    assert parse_cgroup_memory_value(text) == expected


@pytest.mark.parametrize("text, expected", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000\n", 1.5),
                                            ("-1 100000", None)])
def test_parse_cgroup_cpu_max(text, expected):
    assert parse_cgroup_cpu_max(text) == expected


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_and_parent_wins(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    _write(root / "memory.max", "max\n")
    _write(root / "kubepods/pod1/ctr/memory.max", "8589934592\n")
    _write(root / "kubepods/pod1/ctr/memory.current", "1073741824\n")
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert read_cgroup_memory(root, proc) == (8 * GiB, 1 * GiB, str(root / "kubepods/pod1/ctr/memory.max"))
    _write(root / "kubepods/memory.max", "4294967296\n")  # a tighter parent limit applies
    assert read_cgroup_memory(root, proc)[0] == 4 * GiB
    _write(root / "kubepods/pod1/cpu.max", "300000 100000\n")
    assert read_cgroup_cpu(root, proc) == 3.0


def test_cgroup_v1_and_namespaced_root(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(proc, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    _write(root / "memory/docker/abc/memory.limit_in_bytes", "2147483648\n")
    _write(root / "memory/docker/abc/memory.usage_in_bytes", "1000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert read_cgroup_memory(root, proc)[:2] == (2 * GiB, 1000)
    assert read_cgroup_cpu(root, proc) == 0.5
    # inside a cgroup namespace the container's own files sit at the root
    proc2 = tmp_path / "cgroup2"
    _write(proc2, "4:memory:/\n")
    assert read_cgroup_memory(root, proc2)[0] is None  # root says unlimited
    _write(root / "memory/memory.limit_in_bytes", "1073741824\n")
    assert read_cgroup_memory(root, proc2)[0] == 1 * GiB
    assert read_cgroup_memory(tmp_path / "nothing", tmp_path / "none") == (None, None, None)


def test_read_host_applies_cgroup_limit(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(proc, "0::/\n")
    _write(root / "memory.max", f"{1 * GiB}\n")
    _write(root / "memory.current", f"{256 * MiB}\n")
    host = read_host(cgroup_root=root, proc_self_cgroup=proc)
    if host.system != "Linux":
        pytest.skip("cgroups are Linux-only")
    assert host.ram_total_bytes == psutil.virtual_memory().total
    assert host.effective_ram_bytes == min(1 * GiB, host.ram_total_bytes)
    assert host.ram_available_bytes <= 768 * MiB


def test_parse_cpuinfo():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9654\ncpu MHz\t\t: 2400.000\n"
            "flags\t\t: fpu avx2 fma avx512f avx512_bf16 sse\n")
    assert parse_cpuinfo(text) == ("AMD EPYC 9654", ("avx2", "avx512_bf16", "avx512f", "fma"), 2400.0)
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU part\t: 0xd40\n"
    assert parse_cpuinfo(arm)[1] == ("asimd", "bf16", "sve")


def _host(**changes):
    base = dict(hostname="h", system="Linux", machine="x86_64", cpu_model="x",
                cpu_flags=("avx2", "avx512_bf16", "avx512f"), logical_cores=4, physical_cores=2, affinity_cores=4,
                cgroup_cpu_limit=None, cpu_max_mhz=2600.0,
                cpu_mhz_source="test", ram_total_bytes=32 * GiB, ram_available_bytes=30 * GiB,
                cgroup_memory_limit_bytes=None, cgroup_memory_usage_bytes=None, cgroup_memory_source=None)
    base.update(changes)
    return HostReading(**base)


def test_cpu_estimate_uses_best_isa_and_effective_cores():
    flops, how = estimate_cpu_flops(_host(), "bf16")
    assert flops == pytest.approx(2 * 2.6e9 * 40)
    assert "estimated" in how and "AVX-512 BF16" in how
    flops, _ = estimate_cpu_flops(_host(cpu_flags=("avx2",), cgroup_cpu_limit=1.5), "bf16")
    assert flops == pytest.approx(1 * 2.6e9 * 10)  # quota of 1.5 CPUs -> 1 core
    assert _host(cgroup_memory_limit_bytes=8 * GiB).effective_ram_bytes == 8 * GiB


def test_typical_link_scales_with_width():
    link, note = typical_link(4, 8)
    assert link.name == "PCIe 4.0 x8" and link.h2d_pinned_bytes_per_s == 12.5e9
    assert "typical" in note and "not measured" in note
    assert typical_link(None, 16) is None


def test_match_datasheet_by_name_and_memory():
    spec, name = match_datasheet("NVIDIA GeForce RTX 4090", 24564 * MiB)
    assert name == "rtx-4090" and spec.bf16_flops == pytest.approx(165.2e12)
    assert match_datasheet("NVIDIA GeForce RTX 3060", 8 * GiB) is None  # the 8 GB card is another GPU
    assert match_datasheet("NVIDIA H100 PCIe", 81559 * MiB)[1] == "h100-pcie"


# ---------------------------------------------------------------- the probe on fake GPUs (quick path)


def _fake_nvml_gpu(name="NVIDIA GeForce RTX 4090", memory=24564 * MiB, **changes):
    base = dict(index=0, name=name, uuid="GPU-1", memory_total_bytes=memory, memory_free_bytes=memory,
                memory_used_bytes=0, other_processes=0, other_processes_memory_bytes=0, pcie_gen_current=1,
                pcie_gen_max=4, pcie_width_current=16, pcie_width_max=16, memory_clock_max_mhz=10501,
                memory_bus_width_bits=384, sm_clock_max_mhz=2520, cuda_cores=16384, compute_capability="8.9",
                mig_enabled=None, driver_version="550.54.15", cuda_driver_version="12.4")
    base.update(changes)
    return NvmlGpu(**base)


def test_quick_probe_with_a_known_gpu(monkeypatch):
    monkeypatch.setattr(probe_core, "read_nvml",
                        lambda: [_fake_nvml_gpu(index=0), _fake_nvml_gpu(index=1, uuid="GPU-2")])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = probe(quick=True)
    p = r.profile
    assert len(p.gpus) == 1 and p.gpu.count == 2 and p.gpu.memory_bytes == 24564 * MiB
    assert p.gpu.memory_bandwidth_bytes_per_s == 1008e9 and p.gpu.bf16_flops == pytest.approx(165.2e12)
    assert p.link.name == "PCIe 4.0 x16" and p.link.h2d_pinned_bytes_per_s == 25e9
    assert not p.measured and "driver 550.54.15" in p.source
    assert any("datasheet figures from the shipped profile 'rtx-4090'" in n for n in p.notes)
    assert any("typical" in n and "PCIe 4.0 x16" in n for n in p.notes)
    assert p.overheads.cuda_context_bytes == probe_mod.DEFAULT_CUDA_CONTEXT_BYTES
    text = dumps_profile(p)  # the file shows short forms and reloads identically
    assert "kernel_launch: 5 us" in text and "memory_bandwidth: 1008 GB/s" in text
    assert loads_profile(text) == p
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert probe(quick=True).profile.gpu.count == 1


def test_quick_probe_with_an_unknown_gpu(monkeypatch):
    g = _fake_nvml_gpu(name="NVIDIA RTX 9999 Prototype", memory=40 * GiB, compute_capability="8.9",
                       cuda_cores=10000, sm_clock_max_mhz=2000, pcie_gen_max=5, pcie_width_max=8)
    monkeypatch.setattr(probe_core, "read_nvml", lambda: [g])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = probe(quick=True).profile
    assert p.gpu.memory_bandwidth_bytes_per_s == pytest.approx(1008e9, rel=1e-3)  # clock x 2 x bus width
    assert p.gpu.bf16_flops == pytest.approx(10000 * 2.0e9 * 8)
    assert p.link.name == "PCIe 5.0 x8" and p.link.h2d_pinned_bytes_per_s == 25e9
    assert any("derived from NVML" in n for n in p.notes) and any("estimated from NVML" in n for n in p.notes)


def test_quick_probe_with_mig(monkeypatch):
    g = _fake_nvml_gpu(name="NVIDIA A100-SXM4-80GB", memory=81920 * MiB, compute_capability="8.0", mig_enabled=True,
                       mig_devices=(MigDevice("MIG-1", 19968 * MiB),))
    monkeypatch.setattr(probe_core, "read_nvml", lambda: [g])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = probe(quick=True).profile
    assert p.gpu.memory_bytes == 19968 * MiB
    assert any("MIG enabled" in n for n in p.notes)


# ---------------------------------------------------------------- the probe on this machine


def _expected_ram() -> int:
    limit = read_cgroup_memory()[0] if sys.platform.startswith("linux") else None
    total = psutil.virtual_memory().total
    return min(total, limit) if limit else total


def test_quick_probe_on_this_machine():
    r = probe(quick=True)
    p = r.profile
    assert p.host.ram_bytes == _expected_ram()
    assert p.host.ram_bandwidth_bytes_per_s > 1e8 and p.host.cpu_bf16_flops > 1e9
    assert not p.measured
    json.dumps({"profile": profile_to_dict(p), "readings": r.readings})
    assert profile_from_dict(profile_to_dict(p)) == p  # plain data: it round-trips
    if not p.gpus:
        assert p.link is None and p.overheads.cuda_context_bytes == 0 and p.overheads.kernel_launch_s == 0
        assert any("NVML" in n or "no GPU" in n for n in p.notes)


def test_quick_probe_samples_bf16_where_the_flags_do_not_decide_it(monkeypatch):
    """On a CPU with AVX512-BF16 or AMX (this one made to say so), the quick probe times one bf16 matmul with torch
    instead of trusting the flags; elsewhere it estimates from them and imports no torch."""
    pytest.importorskip("torch")
    import dataclasses

    real = probe_core.read_host
    monkeypatch.setattr(probe_core, "read_host",
                        lambda: dataclasses.replace(real(), cpu_flags=(*real().cpu_flags, "amx_bf16", "amx_tile")))
    monkeypatch.setattr(probe_core, "read_nvml", lambda: [])
    r = probe(quick=True)
    note = next(n for n in r.profile.notes if "sampled by the quick probe" in n)
    assert "amx_bf16" in note and "torch bf16" in note
    assert r.profile.host.cpu_bf16_flops > 0 and not any("is estimated, not measured" in n and "bf16" in n
                                                          for n in r.profile.notes)


@pytest.mark.parametrize("flags, estimated", [(("avx2", "fma"), True), (("avx2", "avx512f", "avx512_vnni"), False),
                                               (("asimd",), False)])
def test_quick_probe_estimates_int8_x_int8_where_no_dot_product_instructions(monkeypatch, flags, estimated):
    """x86 without VNNI multiplies int8 by int8 (quanto-w8a8's kernel) by fbgemm's AVX2 path: the quick probe, which
    times no kernel, estimates its rate from the RAM bandwidth there and records that path, and leaves both to the
    defaults elsewhere."""
    import dataclasses

    from vramplan.runtime.probe.host import NO_INT8_DOT_DYNAMIC_RAM_SHARE

    real = probe_core.read_host()
    monkeypatch.setattr(probe_core, "read_host", lambda: dataclasses.replace(real, cpu_flags=flags))
    monkeypatch.setattr(probe_core, "read_nvml", lambda: [])
    h = probe(quick=True).profile.host
    rate = h.cpu_decode_int8_dynamic_bytes_per_s
    assert (rate is not None) == estimated and h.cpu_decode_int8_bytes_per_s is None
    assert h.cpu_decode_int8_dynamic_path == ("fbgemm" if estimated else None) and h.cpu_decode_bf16_path is None
    if estimated:
        assert rate == pytest.approx(NO_INT8_DOT_DYNAMIC_RAM_SHARE * h.ram_bandwidth_bytes_per_s, rel=0.01)


def test_quick_probe_imports_no_torch_and_is_fast(tmp_path):
    """No torch, except on a CPU with native bf16 (AVX512-BF16, AMX), where the quick probe samples one bf16 product
    (its flags do not decide the rate); a check of what the machine has (this_machine_inventory) never imports it."""
    import importlib.util

    from vramplan.runtime.probe.host import NATIVE_BF16_FLAGS, read_host

    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from runtime.this_machine import this_machine_inventory\n"
        "this_machine_inventory()\n"
        "inventory = 'torch' in sys.modules\n"
        "from runtime.probe import probe\n"
        "r = probe(quick=True)\n"
        "from runtime.this_machine import this_machine_profile\n"
        "this_machine_profile()\n"
        "print(inventory, 'torch' in sys.modules, time.perf_counter() - t)\n"
    )
    env = dict(os.environ, VRAMPLAN_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, check=True,
                         timeout=60)
    inventory, imported, seconds = out.stdout.split()
    samples = bool(NATIVE_BF16_FLAGS & set(read_host().cpu_flags)) and importlib.util.find_spec("torch") is not None
    assert inventory == "False" and imported == str(samples)
    assert float(seconds) < 10  # loose: < 2 s on an idle machine


def test_this_machine_profile_is_cached(tmp_path, monkeypatch):
    from vramplan.runtime import this_machine as profiles

    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    first = profiles.this_machine_profile()
    cached = list(tmp_path.glob("this-machine-*.yaml"))
    assert len(cached) == 1 and load_profile(cached[0]) == first

    def boom(**_kw):
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(probe_mod, "probe", boom)
    assert profiles.this_machine_profile() == first
    with pytest.raises(AssertionError, match="probed again"):
        profiles.this_machine_profile(refresh=True)


@pytest.mark.slow
def test_full_probe_on_this_machine():
    pytest.importorskip("torch")
    steps: list[str] = []
    r = probe(quick=False, progress=steps.append)
    p = r.profile
    assert p.measured and p.source.startswith("measured by vramplan probe on ") and "torch" in p.source
    assert p.host.ram_bytes == _expected_ram()
    m = r.readings["measurements"]
    assert m["ram_bandwidth"]["value"] == pytest.approx(p.host.ram_bandwidth_bytes_per_s, rel=1e-3)
    assert m["cpu_bf16_matmul"]["value"] == pytest.approx(p.host.cpu_bf16_flops, rel=1e-3)
    assert len(m["cpu_bf16_matmul"]["samples"]) >= 3
    assert m["cpu_fp32_matmul"]["value"] == pytest.approx(p.host.cpu_fp32_flops, rel=1e-3)
    assert m["cpu_int8_matmul"]["value"] == pytest.approx(p.host.cpu_int8_ops, rel=1e-3)
    assert any("RAM" in s for s in steps) and any("matmul" in s for s in steps)
    assert r.elapsed_s < 60


@pytest.mark.gpu
def test_full_probe_measures_the_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = probe(quick=False).profile
    assert p.measured and p.gpus and p.link is not None
    g = p.gpu
    assert g.memory_bytes > 1 * GiB and g.memory_bandwidth_bytes_per_s > 50e9 and g.bf16_flops > 5e12
    assert 0 < p.overheads.kernel_launch_s < 1e-3
    assert p.link.h2d_pinned_bytes_per_s > 1e9


# ---------------------------------------------------------------- CLI


def test_cli_probe_quick_json_and_save(tmp_path):
    env = dict(os.environ, VRAMPLAN_CONFIG_DIR=str(tmp_path / "config"), VRAMPLAN_PROFILES="")
    r = subprocess.run([sys.executable, "cli.py", "probe", "--quick", "--json", "--save",
                        str(tmp_path / "team/a-node.yaml")],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["profile"]["name"] == "a-node" and "host" in data["readings"]
    saved = load_profile(tmp_path / "team/a-node.yaml")
    assert saved.name == "a-node" and saved.host.ram_bytes == _expected_ram()
    r = subprocess.run([sys.executable, "cli.py", "probe", "--quick"], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0 and "host RAM" in r.stdout


def test_without_the_driver_library_pynvml_is_not_imported(tmp_path):
    """On a machine whose libnvidia-ml does not load, NVML's answer comes without importing pynvml (8 ms of every
    plan there), and the fingerprint's RAM is psutil's figure without importing psutil."""
    import ctypes

    from vramplan.runtime.probe.nvml import NVML_LIBRARY

    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        pass
    else:
        pytest.skip(f"{NVML_LIBRARY} loads here: pynvml is imported, as it must be")
    script = ("import sys\nfrom vramplan.runtime.probe import machine_fingerprint\n"
              "from vramplan.runtime.probe.nvml import NvmlUnavailable, read_nvml\n"
              "try:\n    read_nvml()\nexcept NvmlUnavailable as e:\n    print('unavailable:', e)\n"
              "f = machine_fingerprint()\nprint('imported:', 'pynvml' in sys.modules, 'psutil' in sys.modules)\n"
              "import psutil\nprint('ram equal:', f['ram_total'] == psutil.virtual_memory().total, f['gpus'])\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "unavailable: NVML did not start" in r.stdout and "no NVIDIA driver" in r.stdout
    assert "imported: False False" in r.stdout and "ram equal: True []" in r.stdout


def test_cpu_fp32_and_int8_estimates_follow_the_vector_extensions():
    """The quick probe's fp32 and int8 matmul figures (what a CPU prefill's kernels compute against where bf16 is
    converted in software): per cycle by the widest extension, none where no flag gives a rate."""
    flops, how = estimate_cpu_flops(_host(cpu_flags=("avx2", "avx512_vnni", "avx512f", "fma")), "fp32")
    assert flops == pytest.approx(2 * 2.6e9 * 64) and "AVX-512 FMA" in how and "estimated" in how
    ops, how = estimate_cpu_flops(_host(cpu_flags=("avx2", "avx512_vnni", "avx512f", "fma")), "int8")
    assert ops == pytest.approx(2 * 2.6e9 * 256) and "ops/cycle" in how
    assert estimate_cpu_flops(_host(cpu_flags=("avx2", "fma")), "fp32")[0] == pytest.approx(2 * 2.6e9 * 32)
    none, why = estimate_cpu_flops(_host(cpu_flags=("avx2", "fma")), "int8")
    assert none is None and "not estimated" in why
    assert estimate_cpu_flops(_host(cpu_flags=()), "fp32")[0] is None
    # native bf16 (AVX512-BF16 here): vramplan's CPU path keeps bf16 matmuls, no fp32 figure for the planner to prefer
    none, why = estimate_cpu_flops(_host(), "fp32")
    assert none is None and "bf16 is native here" in why


def test_the_full_probe_measures_the_fp32_and_int8_matmuls():
    torch = pytest.importorskip("torch")
    for kind in ("fp32", "int8"):
        m = measure_cpu_matmul(torch, kind, repeats=1)
        assert m.name == f"cpu_{kind}_matmul" and m.value > 0 and kind in m.method
