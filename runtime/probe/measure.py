"""Measurements of this machine: RAM and GPU bandwidth, the host link, matmuls, kernel launches."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from vramplan.planner.units import MiB, format_bytes

# RAM bandwidth: copy this many bytes (quick probe / full probe), counted read + written, best of repeats.
QUICK_RAM_COPY_BYTES = 128 * MiB
QUICK_RAM_REPEATS = 5
FULL_RAM_COPY_BYTES = 512 * MiB
FULL_REPEATS = 7
RAM_COPY_MAX_THREADS = 16

@dataclass(frozen=True)
class Measurement:
    name: str
    value: float  # the median of the samples (RAM bandwidth: the best, see measure_ram_bandwidth)
    unit: str  # "B/s", "FLOP/s", "s", "B"
    samples: tuple[float, ...]
    method: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- measurements


def _median_measurement(name: str, unit: str, work: float, times: list[float], method: str) -> Measurement:
    samples = tuple(work / t for t in times if t > 0)
    if not samples:
        raise RuntimeError(f"{name}: timer resolution too coarse")
    return Measurement(name, statistics.median(samples), unit, samples, method)


def measure_ram_bandwidth(nbytes: int = QUICK_RAM_COPY_BYTES, repeats: int = QUICK_RAM_REPEATS,
                          threads: int | None = None) -> Measurement:
    """RAM copy bandwidth: a buffer far larger than any cache copied by `threads` threads at once
    (ctypes.memmove releases the GIL: plain memcpy on every core, with or without numpy or torch),
    read + written bytes counted. The value is the best of the repeats, not their median: another
    process can only slow a copy down, so the fastest repeat is the closest to the idle machine."""
    from concurrent.futures import ThreadPoolExecutor

    n_threads = max(1, min(threads or (os.cpu_count() or 1), RAM_COPY_MAX_THREADS))
    src = (ctypes.c_char * nbytes)()
    dst = (ctypes.c_char * nbytes)()
    ctypes.memset(src, 0x5A, nbytes)  # touched, so no shared zero page flatters the result
    src_at, dst_at = ctypes.addressof(src), ctypes.addressof(dst)
    bounds = [(i * nbytes // n_threads, (i + 1) * nbytes // n_threads) for i in range(n_threads)]

    def copy(b: tuple[int, int]) -> None:
        ctypes.memmove(dst_at + b[0], src_at + b[0], b[1] - b[0])

    with ThreadPoolExecutor(n_threads) as pool:
        list(pool.map(copy, bounds))  # fault the destination's pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(copy, bounds))
            times.append(time.perf_counter() - t0)
    samples = tuple(2 * nbytes / t for t in times if t > 0)
    if not samples:
        raise RuntimeError("ram_bandwidth: timer resolution too coarse")
    return Measurement("ram_bandwidth", max(samples), "B/s", samples,
                       f"memcpy of {format_bytes(nbytes)} in {n_threads} threads, read+write counted, "
                       f"best of {repeats}")


def _matmul_size(rate_guess: float, target_s: float, lo: int = 512, hi: int = 8192) -> int:
    n = int(round((rate_guess * target_s / 2) ** (1 / 3) / 256)) * 256
    return max(lo, min(hi, n))


# the torch dtype of each CPU matmul the probe times
_CPU_MATMUL_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8"}


# The square sizes a CPU matmul is timed at, and how long one timed product should take: the largest size whose
# product the first guess says takes at most this long. A CPU converting bf16 in software can be 1,000x slower than
# its fp32 (an AVX2 EPYC: 0.3 GFLOPS bf16, 104 fp32), so the size follows the machine, never a fixed 2048 (385 s).
CPU_MATMUL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
CPU_MATMUL_TARGET_S = 0.05


# The kernel each CPU scheme decodes with (planner.hardware.CPU_DECODE_KERNELS), timed one row by a weight matrix of
# about this many bytes in its own format: well past the caches, so the rate is the weights streamed from RAM.
CPU_DECODE_BYTES = 64 * MiB
# A decode step reads each matrix once a token, after the rest of the model has passed through the caches: before each
# timed product the probe reads a buffer the size of the last-level cache (last_level_cache_bytes; at most
# FLUSH_MAX_BYTES and an eighth of the available RAM), so that the product reads its weights from RAM. A read, not a
# write: written lines would be written back during the timed product, which a decode step's clean weights never are.
# Without it the 2-core Xeon VM (an L3 of 480 MiB as its sysfs reports it, 2026-11-29) kept a 64 MiB matrix cached:
# cpu-w4a8's kernel timed 25.8-28.8 GB/s there, and it streams Qwen2.5-0.5B's 96 matrices in turn at 12.5.
FLUSH_MAX_BYTES = 1024 * MiB
# A kernel's other path replaces the CPU's default one (runtime.cpu_paths.default_path) only when it streamed at least
# this much faster: bf16 by torch.mv and by F.linear timed 10.65 / 11.08 and 9.47 / 9.51 GB/s in two probes of the AVX2
# EPYC VM, an order that noise decides
PATH_MARGIN = 1.1


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size, as Linux's sysfs reports it for CPU 0 (None elsewhere)."""
    sizes = []
    for index in sorted(os.listdir(_CACHE_DIR)) if os.path.isdir(_CACHE_DIR) else ():
        try:
            with open(os.path.join(_CACHE_DIR, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024 * 1024, "G": 1024 ** 3}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KkMmGg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def measure_cpu_decode_kernels(torch: Any, repeats: int = 5, nbytes: int = CPU_DECODE_BYTES,
                               flush_bytes: int | None = -1) -> tuple[dict[str, Measurement], dict[str, str]]:
    """Bytes of weights per second each CPU decode kernel streams from RAM at one row, on all torch threads, and for
    the kernels the runtime runs by more than one path (planner.hardware.CPU_DECODE_PATHS, runtime.cpu_paths) the path
    that was fastest; each timed product after `flush_bytes` read (-1: the last-level cache's size, capped as
    FLUSH_MAX_BYTES says; None: no flush). Kernels: bf16 (torch.mv, runtime.quantize.Bf16Rows, or F.linear), int8 rows
    (_weight_int8pack_mm), int4 groups of 128 (_weight_int4pack_mm_for_cpu), int8 x int8 (quanto-w8a8's:
    runtime.experts.int8_dynamic_mm by torch._int_mm, or fbgemm's dynamic linear, runtime.cpu_paths) and, where it
    builds, vramplan's int4 x int8 kernel (cpu-w4a8's, runtime.cpu_kernel). Which is fast
    depends on the CPU, not on its nominal FLOPS: on an AVX2 EPYC without VNNI _int_mm streamed 1.9 GB/s where the
    int8 rows streamed 9.0 (2 threads, 2026-11-29). Returns ({kernel: the rate of its fastest path}, {kernel: that
    path}); every path's own timing is kept in the first as "<kernel>_<path>"."""
    from vramplan.planner.quant import CPU_W4A8_GROUP
    from vramplan.runtime import cpu_kernel
    from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic, default_path, fbgemm_available
    from vramplan.runtime.experts import int8_dynamic_mm

    k = 4096
    n = nbytes // k // 8 * 8  # rows of an int8 matrix of that many bytes
    row = torch.randn(1, k).to(torch.bfloat16)
    int8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n).to(torch.bfloat16)
    bf16 = int8[: n // 2].to(torch.bfloat16)  # the same bytes in bf16
    # and in int4, packed 1024 rows at a time (whole row tiles): no int32 copy of the whole matrix
    packed = torch.cat([torch._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (min(1024, 2 * n - r), k), dtype=torch.int32), 8) for r in range(0, 2 * n, 1024)])
    scale_zeros = torch.rand(k // 128, 2 * n, 2).to(torch.bfloat16)
    fbgemm = FbgemmInt8Dynamic(int8, scale, None) if fbgemm_available() else None
    # kernel -> path -> (product, bytes, label)
    kernels: dict[str, dict[str | None, tuple]] = {
        "bf16": {"mv": (lambda: torch.mv(bf16, row[0]), bf16.numel() * 2, "torch.mv bf16"),
                 "linear": (lambda: torch.nn.functional.linear(row, bf16), bf16.numel() * 2, "F.linear bf16")},
        "int8": {None: (lambda: torch._weight_int8pack_mm(row, int8, scale), int8.numel(),
                        "torch._weight_int8pack_mm")},
        "int4": {None: (lambda: torch._weight_int4pack_mm_for_cpu(row, packed, 128, scale_zeros),
                        packed.numel() + scale_zeros.numel() * 2, "torch._weight_int4pack_mm_for_cpu, groups of 128")},
        "int8_dynamic": {"int_mm": (lambda: int8_dynamic_mm(row, int8, scale), int8.numel(),
                                    "runtime.experts.int8_dynamic_mm (torch._int_mm)")},
    }
    if fbgemm is not None:
        kernels["int8_dynamic"]["fbgemm"] = (lambda: fbgemm(row), int8.numel(),
                                             "fbgemm's dynamic int8 linear (runtime.cpu_paths.FbgemmInt8Dynamic)")
    if cpu_kernel.unavailable() is None:  # (built here at the first call; else no rate, and the planner refuses it)
        codes = torch.randint(0, 256, (2 * n, k // 2), dtype=torch.uint8)
        groups = torch.rand(2 * n, k // CPU_W4A8_GROUP, 2).to(torch.bfloat16)
        kernels["int4_a8"] = {None: (lambda: cpu_kernel.w4a8_mm(row, codes, groups, CPU_W4A8_GROUP),
                                     codes.numel() + groups.numel() * 2,
                                     f"vramplan's w4a8 kernel (runtime.cpu_kernel), groups of {CPU_W4A8_GROUP}")}
    if flush_bytes == -1:
        import psutil

        flush_bytes = min(last_level_cache_bytes() or 0, FLUSH_MAX_BYTES, psutil.virtual_memory().available // 8)
    flush = torch.ones(flush_bytes, dtype=torch.uint8) if flush_bytes else None
    out: dict[str, Measurement] = {}
    paths: dict[str, str] = {}
    for name, by_path in kernels.items():
        timed = {}
        for path, (product, nbytes, label) in by_path.items():
            product()
            times = []
            for _ in range(repeats):
                if flush is not None:  # the caches hold other (clean) bytes now, as in a decode step
                    flush.max()
                t0 = time.perf_counter()
                product()
                times.append(time.perf_counter() - t0)
            key = name if path is None else f"{name}_{path}"
            timed[path] = out[key] = _median_measurement(
                f"cpu_decode_{key}", "B/s", nbytes, times,
                f"{label}, one row by {format_bytes(nbytes)} of weights, {torch.get_num_threads()} threads"
                + (f", {format_bytes(flush_bytes)} read before each (the last-level cache)" if flush is not None
                   else ""))
        best = max(timed, key=lambda p: timed[p].value)  # type: ignore[arg-type]
        if best is not None and default_path(name) in timed \
                and timed[best].value < PATH_MARGIN * timed[default_path(name)].value:
            best = default_path(name)  # within the timing's noise: the CPU's default stays
        if best is not None:
            paths[name] = best
            m = timed[best]
            out[name] = Measurement(f"cpu_decode_{name}", m.value, m.unit, m.samples,
                                    f"the fastest of its paths: {best} ({m.method})")
    return out, paths


def measure_cpu_matmul(torch: Any, kind: str, repeats: int = 5, path: str | None = None) -> Measurement:
    """A square CPU matmul's rate on all torch threads (FLOP/s; int8: multiply-adds counted as 2 ops), `kind` one of
    bf16, fp32, int8: quanto-w8a8's matmuls, by `path` (runtime.cpu_paths) "int_mm" (the default: torch._int_mm, int8
    x int8 into int32 sums, runtime.experts.int8_dynamic_mm's kernel) or "fbgemm" (fp32 rows quantized per token and
    multiplied by packed int8 rows, runtime.cpu_paths.FbgemmInt8Dynamic, all of it timed). A first product of the
    smallest size guesses the rate; the timed size is the largest of CPU_MATMUL_SIZES whose product that guess says
    takes at most CPU_MATMUL_TARGET_S, so the whole measurement takes about a second on any CPU, slow kernels
    included."""
    dtype = getattr(torch, _CPU_MATMUL_DTYPES[kind])
    if kind == "int8" and path == "fbgemm":
        from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic

        label = "fbgemm's dynamic int8 linear (runtime.cpu_paths)"

        def product(a, b):  # fbgemm's packed rows b times the fp32 rows a
            return b(a)

        def pair(n: int):
            weight = torch.randint(-127, 128, (n, n), dtype=torch.int8)
            return torch.randn(n, n), FbgemmInt8Dynamic(weight, torch.rand(n) / 100, None)
    else:
        label = "torch._int_mm int8" if kind == "int8" else f"torch {kind}"
        product = torch._int_mm if kind == "int8" else torch.mm

        def operand(n: int):
            if kind == "int8":
                return torch.randint(-127, 128, (n, n), dtype=dtype)
            return torch.randn(n, n).to(dtype)

        def pair(n: int):
            return operand(n), operand(n)

    def once(a, b) -> float:
        t0 = time.perf_counter()
        product(a, b)
        return time.perf_counter() - t0

    guess_n = CPU_MATMUL_SIZES[1]  # _int_mm wants more than 16 rows; the smallest size only if the guess says so
    a, b = pair(guess_n)
    product(a, b)
    guess = 2 * guess_n**3 / max(once(a, b), 1e-9)
    n = max([k for k in CPU_MATMUL_SIZES if 2 * k**3 / guess <= CPU_MATMUL_TARGET_S], default=CPU_MATMUL_SIZES[0])
    a, b = pair(n)
    product(a, b)
    times = [once(a, b) for _ in range(repeats)]
    return _median_measurement(f"cpu_{kind}_matmul", "FLOP/s", 2 * n**3, times,
                               f"{label} {n}x{n} @ {n}x{n} on {torch.get_num_threads()} threads")


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elif device == "mps":
        torch.mps.synchronize()


def _timed(torch: Any, device: str, fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()
    _sync(torch, device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return times


def measure_gpu_memory_bandwidth(torch: Any, device: str, nbytes: int) -> Measurement:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.fill_(1)
    b = torch.empty_like(a)
    times = _timed(torch, device, lambda: b.copy_(a), FULL_REPEATS * 2)
    return _median_measurement("gpu_memory_bandwidth", "B/s", 2 * nbytes, times,
                               f"device-to-device copy of {format_bytes(nbytes)}, read+write counted")


def measure_host_link(torch: Any, device: str, nbytes: int) -> dict[str, Measurement]:
    """h2d / d2h bandwidth from pinned and from pageable host memory."""
    out: dict[str, Measurement] = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.full((nbytes,), 1, dtype=torch.uint8)
    pinned = None
    if device.startswith("cuda"):
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
    for kind, host in (("pinned", pinned), ("pageable", pageable)):
        if host is None:
            continue
        t = _timed(torch, device, lambda: dev.copy_(host, non_blocking=kind == "pinned"), FULL_REPEATS)
        out[f"h2d_{kind}"] = _median_measurement(f"h2d_{kind}", "B/s", nbytes, t,
                                                 f"host->device copy of {format_bytes(nbytes)} from {kind} memory")
        t = _timed(torch, device, lambda: host.copy_(dev, non_blocking=kind == "pinned"), FULL_REPEATS)
        out[f"d2h_{kind}"] = _median_measurement(f"d2h_{kind}", "B/s", nbytes, t,
                                                 f"device->host copy of {format_bytes(nbytes)} to {kind} memory")
    return out


def measure_gpu_matmul_bf16(torch: Any, device: str, repeats: int = 10) -> Measurement:
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    t = _timed(torch, device, lambda: a @ a, 3)
    guess = 2 * 2048**3 / max(statistics.median(t), 1e-6)
    n = _matmul_size(guess, 0.02, lo=2048, hi=16384)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = _timed(torch, device, lambda: a @ b, repeats)
    return _median_measurement("gpu_bf16_matmul", "FLOP/s", 2 * n**3, times, f"torch bf16 {n}x{n} @ {n}x{n}")


def measure_kernel_launch(torch: Any, device: str, launches: int = 2000, repeats: int = 5) -> Measurement:
    """Seconds per launch of a trivial kernel, back to back (launch-bound, not compute-bound)."""
    x = torch.zeros(1, device=device)

    def burst() -> None:
        for _ in range(launches):
            x.add_(1)

    times = _timed(torch, device, burst, repeats)
    samples = tuple(t / launches for t in times)
    return Measurement("kernel_launch", statistics.median(samples), "s", samples,
                       f"{launches} back-to-back x.add_(1) on a 1-element tensor")


# A routed expert's call timed at shapes whose bytes take no time (hidden 256, expert width 128: 0.1 MB an expert in
# int4), as the runtime's eager MoE decode calls it: one token, EXPERT_CALL_TOP_K of EXPERT_CALL_EXPERTS experts.
EXPERT_CALL_SHAPE = (256, 128)
EXPERT_CALL_EXPERTS, EXPERT_CALL_TOP_K = 8, 2


def measure_cpu_expert_call(torch: Any, repeats: int = 7, calls: int = 50, scheme: str = "quanto-int4") -> Measurement:
    """The fixed cost of one routed expert's eager forward for one token on the CPU (s): runtime.experts'
    QuantizedExperts of `scheme` (quanto's int4 by default, the CPU MoE scheme), one token routed to
    EXPERT_CALL_TOP_K experts, per expert. It moves with the machine: about 50 us on the Xeon dev VM, 268 us on the
    AVX2 EPYC VM (2026-11-29)."""
    from vramplan.planner.quant import SCHEMES
    from vramplan.runtime.experts import QuantizedExperts, random_experts

    hidden, width = EXPERT_CALL_SHAPE
    generator = torch.Generator().manual_seed(0)
    experts = random_experts(hidden, width, EXPERT_CALL_EXPERTS, EXPERT_CALL_TOP_K, generator)
    module = QuantizedExperts(experts, SCHEMES[scheme], "cpu")
    x = torch.randn(1, hidden, generator=generator).to(torch.bfloat16)
    index = torch.arange(EXPERT_CALL_TOP_K).view(1, -1)
    weights = torch.full((1, EXPERT_CALL_TOP_K), 1.0 / EXPERT_CALL_TOP_K)
    with torch.no_grad():
        for _ in range(5):
            module(x, index, weights)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                module(x, index, weights)
            times.append((time.perf_counter() - t0) / (calls * EXPERT_CALL_TOP_K))
    return Measurement("cpu_expert_call", statistics.median(times), "s", tuple(times),
                       f"runtime.experts.QuantizedExperts ({scheme}, hidden {hidden}, expert width {width}), one token "
                       f"to {EXPERT_CALL_TOP_K} of {EXPERT_CALL_EXPERTS} experts, per expert, median of {repeats} x "
                       f"{calls} calls, {torch.get_num_threads()} threads")


# A decoder layer's fixed cost per CPU scheme (planner.hardware.CPU_LAYER_COSTS), timed on tiny Llama models whose
# weights take no time: the median decode step of LAYER_PROBE_LAYERS[1] layers less that of LAYER_PROBE_LAYERS[0] (the
# embedding and the head cancel), over the layers between, after a LAYER_PROBE_PROMPT-token prompt. On the 2-core Xeon
# AMX VM (2026-11-29) a 4-layer tiny model in cpu-w4a8 took 414 us a layer (step over layers) in transformers' forward
# and 255 in vramplan's own step, where Qwen2.5-0.5B's step with its kernels emptied left 326-353 and 227-239
# (bench/lean_cpu.py); the speed model's defaults, fitted on another machine, say 710 and 476.
LAYER_PROBE_CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
                          tie_word_embeddings=False)
LAYER_PROBE_LAYERS = (2, 6)
LAYER_PROBE_PROMPT = 128
LAYER_PROBE_STEPS = 16


def measure_cpu_layer_costs(torch: Any, paths: dict[str, str]) -> tuple[dict[str, Measurement], dict[str, str]]:
    """({CPU_LAYER_COSTS name: the fixed cost of one decoder layer of a decode step (s)}, {name: why it was not
    timed}), each scheme loaded as the runtime loads it (runtime.load, the kernels' `paths` the probe chose) and run
    under the grad mode the runtime runs it in; "lean" is cpu-w4a8 in vramplan's own decoder step (runtime.lean).
    cpu-w4a8's two are left out where its kernel does not build; a scheme that fails, or whose more layers did not take
    longer (a busy machine), is left out with the reason, and the others stand."""
    from vramplan.planner.hardware import CPU_DECODE_KERNELS, CPU_LAYER_COSTS
    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.runtime import cpu_kernel
    from vramplan.runtime.generate import decode_one_token, no_grad_context, prefill, synthetic_prompt
    from vramplan.runtime.kvcache import make_cache
    from vramplan.runtime.lean import LeanDecoder
    from vramplan.runtime.load import load_model

    def step_s(name: str, layers: int) -> float:
        scheme = SCHEMES[CPU_DECODE_KERNELS["int4_a8" if name == "lean" else name]]
        model = load_model({**LAYER_PROBE_CONFIG, "num_hidden_layers": layers}, scheme=scheme, dummy_weights=True,
                           device="cpu", cpu_paths=paths).model
        ids = synthetic_prompt(LAYER_PROBE_PROMPT, LAYER_PROBE_CONFIG["vocab_size"], seed=1)
        cache = (LeanDecoder(model, LAYER_PROBE_PROMPT + LAYER_PROBE_STEPS) if name == "lean"
                 else make_cache(KV_SCHEMES["bf16"], model.config))
        token, times = torch.tensor([[11]]), []
        with no_grad_context(model, cache if name == "lean" else None):
            prefill(model, ids, cache, LAYER_PROBE_PROMPT)
            for i in range(LAYER_PROBE_STEPS):
                t0 = time.perf_counter()
                decode_one_token(model, token, LAYER_PROBE_PROMPT + i, cache)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[2:])

    out, skipped = {}, {}
    few, many = LAYER_PROBE_LAYERS
    for name in CPU_LAYER_COSTS:
        if name in ("int4_a8", "lean") and (why := cpu_kernel.unavailable()) is not None:
            skipped[name] = f"cpu-w4a8's kernel: {why}"
            continue
        try:
            steps = tuple(step_s(name, n) for n in LAYER_PROBE_LAYERS)
        except Exception as e:  # noqa: BLE001 - this scheme's default stays, the others are timed
            skipped[name] = f"{type(e).__name__}: {e}"
            continue
        if steps[1] <= steps[0]:
            skipped[name] = f"{many} layers took no longer than {few} ({1e3 * steps[1]:.2f} against " \
                            f"{1e3 * steps[0]:.2f} ms a step): a busy machine"
            continue
        how = "vramplan's own decoder step (runtime.lean)" if name == "lean" else "transformers' eager forward"
        out[name] = Measurement(
            f"cpu_layer_{name}", (steps[1] - steps[0]) / (many - few), "s", steps,
            f"{CPU_DECODE_KERNELS['int4_a8' if name == 'lean' else name]} in {how}: tiny Llama (hidden "
            f"{LAYER_PROBE_CONFIG['hidden_size']}), median decode step of {many} layers less {few}, over {many - few}, "
            f"after {LAYER_PROBE_PROMPT} tokens, {torch.get_num_threads()} threads")
    return out, skipped
