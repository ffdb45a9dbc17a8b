"""vramplan's own CPU kernel: 4-bit weights times 8-bit activations (the cpu-w4a8 scheme, planner.quant), what
llama.cpp's Q4_0 x Q8_0 product does on a CPU without VNNI. torch's 4-bit CPU kernel (_weight_int4pack_mm_for_cpu,
quanto-int4's) widens every weight to float and streams its bytes at about 6 GB/s on the 2-core AVX2 EPYC VM, where
this one reads the same bytes at 11.5-12.3 (bench/results/cpu-int4-kernel-cpu-epyc-avx2.md: the experiment it comes
from).

The layout: each row's 4-bit codes in groups of GROUP along the row, value = (code - 8) x scale + zero with a bf16 scale
and zero per group (gpt-fast's group_quantize, runtime.weight_only.group_quantize); each 32 codes of a row as 16 bytes,
codes 0-15 in the low nibbles and 16-31 in the high (ggml's Q4_0 order), so that one 16-byte load unpacks into 32
unsigned bytes for AVX2's vpmaddubsw. Stored: out x in / 2 bytes of codes and out x in / GROUP x 4 bytes of scales and
zeros [out, in / GROUP, 2], as planner.quant counts them.

The product, one C call per matmul (no torch op between): each input row quantized to int8 per group of GROUP (absmax /
127, rounded to nearest even), then per output row the group's integer dot products summed in int32 and scaled once,
plus (zero - 8 x scale) x the group's sum of the quantized inputs. Output rows are split over OpenMP threads; the
library links the libgomp torch loaded, so torch.set_num_threads sets both. Several input rows (a prefill) unpack four
weight rows at a time into a buffer and multiply every input row by them.

The kernel is built by the machine's C compiler ($CC, else `cc`, else `gcc`) with AVX2 and FMA, at first use, into
vramplan's cache (runtime.files.cache_dir()/kernels/<the source's hash>/), and called through ctypes; torch.compile
reaches it through a custom op (vramplan::w4a8_linear). Where it cannot be built (no x86-64 with AVX2, no compiler),
`unavailable()` says why, the probe records no rate for it and the planner refuses the scheme.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from vramplan.planner.quant import CPU_W4A8_GROUP, w4a8_packs
from vramplan.runtime.files import CacheDirError, cache_dir
from vramplan.runtime.probe.host import c_compiler
from vramplan.runtime.weight_only import ROWS_PER_BLOCK, group_quantize, replace_linears

# The includes and small AVX2 helpers (bf16 conversions, horizontal sums): the kernel's, and bench/cpu_int4_kernel.py's
# experiments'.
C_HELPERS = r"""
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
"""

C_SOURCE = C_HELPERS + r"""
#define PARALLEL_MIN_WEIGHTS (1L << 18)
/* A decode step streams each thread's rows once: prefetching this far ahead of the load raised the rate from 10.2 to
   12.1-13.9 GB/s on the AVX2 EPYC VM (Llama-3.2-1B's 112 matrices in turn, 517 MB; a plain AVX2 read of RAM there:
   12.8-14.7 GB/s); 256 B ahead gave 11.8, 4-6 KiB 10.7-11.4. */
#define PREFETCH_BYTES 2048

static inline __m256 load8(const void *x, int bf16, long i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* One row of K inputs (fp32 or bf16) to int8 per group: codes xq, scale dx[g] = absmax / 127, and xs[g] = dx[g] x the
   group's sum of codes (the quantized inputs' sum). Rounds to nearest even (the default MXCSR mode). */
static void quantize_row(const void *x, int bf16, int K, int group, int8_t *xq, float *dx, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < K / group; g++) {
        const long k0 = (long)g * group;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(x, bf16, k0 + i)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f, inv = d > FLT_MIN ? 1.0f / d : 0.0f;
        __m256i total = _mm256_setzero_si256();
        for (int i = 0; i < group; i += 32) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) {
                q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, bf16, k0 + i + 8 * j), _mm256_set1_ps(inv)));
                total = _mm256_add_epi32(total, q[j]);
            }
            /* int32 x 32 -> int8 x 32 in order: packs interleave 128-bit lanes, the permute restores it */
            __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(xq + k0 + i), w);
        }
        dx[g] = d;
        xs[g] = d * (float)hsum_i32(total);
    }
}

static inline __m256i unpack32(const uint8_t *p) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
}

static inline void store(void *y, int bf16, long i, float v) {
    if (bf16) ((uint16_t *)y)[i] = f32_to_bf16(v); else ((float *)y)[i] = v;
}

/* sum over groups of one weight row (codes `row`, scales `rsz`) times one quantized input row */
static inline float dot_row(const uint8_t *row, const uint16_t *rsz, const int8_t *xq, const float *dx,
                            const float *xs, int K, int group) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int g = 0; g < K / group; g++) {
        __m256i isum = _mm256_setzero_si256();
        for (int b = 0; b < group; b += 32) {
            const long k = (long)g * group + b;
            _mm_prefetch((const char *)(row + k / 2) + PREFETCH_BYTES, _MM_HINT_T0);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(
                _mm256_maddubs_epi16(unpack32(row + k / 2), _mm256_loadu_si256((const __m256i *)(xq + k))), ones));
        }
        const float s = bf16_to_f32(rsz[2 * g]), z = bf16_to_f32(rsz[2 * g + 1]);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s * dx[g]), total);
        offset += (z - 8.0f * s) * xs[g];
    }
    return hsum(total) + offset;
}

/* Four unpacked weight rows `w` [4, K] (their scales from `sz`, `rows` of them real) times `pair` (1 or 2)
   quantized input rows: y[out + i * N + r]. Eight int32 accumulators, two inputs and a weight in registers. */
static inline void tile4x2(const uint8_t *w, const uint16_t *sz, int rows, const int8_t *xq, const float *dx,
                           const float *xs, int pair, int K, int group, void *y, int y_bf16, long out, int N) {
    const int G = K / group;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *q1 = pair > 1 ? xq + K : xq;  /* one input row: the second lane repeats it, never stored */
    __m256 total[2][4];
    float offset[2][4] = {{0}};
    for (int i = 0; i < 2; i++) for (int r = 0; r < 4; r++) total[i][r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i s00 = _mm256_setzero_si256(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00,
                s13 = s00;
        for (int b = 0; b < group; b += 32) {
            const long k = (long)g * group + b;
            const __m256i a0 = _mm256_loadu_si256((const __m256i *)(xq + k));
            const __m256i a1 = _mm256_loadu_si256((const __m256i *)(q1 + k));
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
            s00 = _mm256_add_epi32(s00, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a0), ones));
            s10 = _mm256_add_epi32(s10, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a1), ones));
            v = _mm256_loadu_si256((const __m256i *)(w + K + k));
            s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a0), ones));
            s11 = _mm256_add_epi32(s11, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a1), ones));
            v = _mm256_loadu_si256((const __m256i *)(w + 2 * (size_t)K + k));
            s02 = _mm256_add_epi32(s02, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a0), ones));
            s12 = _mm256_add_epi32(s12, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a1), ones));
            v = _mm256_loadu_si256((const __m256i *)(w + 3 * (size_t)K + k));
            s03 = _mm256_add_epi32(s03, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a0), ones));
            s13 = _mm256_add_epi32(s13, _mm256_madd_epi16(_mm256_maddubs_epi16(v, a1), ones));
        }
        const __m256i sums[2][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}};
        for (int r = 0; r < rows; r++) {
            const float s = bf16_to_f32(sz[((size_t)r * G + g) * 2]), z = bf16_to_f32(sz[((size_t)r * G + g) * 2 + 1]);
            for (int i = 0; i < pair; i++) {
                total[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][r]), _mm256_set1_ps(s * dx[i * G + g]),
                                              total[i][r]);
                offset[i][r] += (z - 8.0f * s) * xs[i * G + g];
            }
        }
    }
    for (int i = 0; i < pair; i++)
        for (int r = 0; r < rows; r++) store(y, y_bf16, out + (long)i * N + r, hsum(total[i][r]) + offset[i][r]);
}

/* y[M, N] = x[M, K] times the [N, K] matrix (codes [N, K/2], sz [N, K/group, 2] bf16); x and y fp32 or bf16
   (x_bf16, y_bf16). Returns 0, or -1 when a buffer could not be allocated. */
int w4a8_linear(const void *x, int x_bf16, const uint8_t *codes, const uint16_t *sz, void *y, int y_bf16,
                int M, int N, int K, int group) {
    const int G = K / group;
    /* a decode step's quantized row in a buffer this thread keeps (no allocation a call); a prefill's allocated */
    static __thread int8_t *row_q = NULL;
    static __thread float *row_s = NULL;
    static __thread int row_k = 0, row_g = 0;
    if (M == 1 && (K > row_k || G > row_g)) {
        free(row_q); free(row_s);
        row_q = (int8_t *)malloc((size_t)K);
        row_s = (float *)malloc(sizeof(float) * 2 * (size_t)G);
        row_k = row_q && row_s ? K : 0;
        row_g = row_k ? G : 0;
        if (!row_k) return -1;
    }
    int8_t *xq = M == 1 ? row_q : (int8_t *)malloc((size_t)M * K);
    float *dx = M == 1 ? row_s : (float *)malloc(sizeof(float) * (size_t)M * G);
    float *xs = M == 1 ? row_s + G : (float *)malloc(sizeof(float) * (size_t)M * G);
    if (M > 1 && (!xq || !dx || !xs)) { free(xq); free(dx); free(xs); return -1; }
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + (size_t)m * K * (x_bf16 ? 2 : 4), x_bf16, K, group, xq + (size_t)m * K,
                     dx + (size_t)m * G, xs + (size_t)m * G);
    if (M == 1) {  /* a decode step: stream each weight row once (a small matrix on one thread: no fork) */
        #pragma omp parallel for schedule(static) if ((long)N * K >= PARALLEL_MIN_WEIGHTS)
        for (int n = 0; n < N; n++)
            store(y, y_bf16, n, dot_row(codes + (size_t)n * (K / 2), sz + (size_t)n * G * 2, xq, dx, xs, K, group));
    } else {  /* a prefill: four weight rows unpacked once, input rows multiplied by them two at a time */
        const int tiles = (N + 3) / 4;
        int failed = 0;
        #pragma omp parallel
        {
            uint8_t *w = (uint8_t *)malloc((size_t)4 * K);
            if (!w) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(static)
            for (int t = 0; t < tiles; t++) {
                if (!w) continue;
                const int n0 = 4 * t, rows = N - n0 < 4 ? N - n0 : 4;
                memset(w, 0, (size_t)4 * K);  /* a short tile's missing rows multiply as zeros */
                for (int r = 0; r < rows; r++)
                    for (int k = 0; k < K; k += 32)
                        _mm256_storeu_si256((__m256i *)(w + (size_t)r * K + k),
                                            unpack32(codes + (size_t)(n0 + r) * (K / 2) + k / 2));
                for (int m = 0; m < M; m += 2) {
                    const int pair = M - m < 2 ? 1 : 2;
                    tile4x2(w, sz + (size_t)n0 * G * 2, rows, xq + (size_t)m * K, dx + (size_t)m * G,
                            xs + (size_t)m * G, pair, K, group, y, y_bf16, (long)m * N + n0, N);
                }
            }
            free(w);
        }
        free(xq); free(dx); free(xs);
        if (failed) return -1;
    }
    return 0;
}
"""

# What the kernel is compiled with; a change of either rebuilds it (the directory is named by their hash).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
LIBRARY = "libvramplan_w4a8.so"


def _cpu_reason() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"its kernel is x86-64 AVX2 code; this CPU is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "its kernel needs AVX2 and FMA, which this CPU lacks (torch's capability: " \
               f"{torch.backends.cpu.get_cpu_capability()})"
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the built library, None) or (None, why it is not available)."""
    reason = _cpu_reason()
    if reason:
        return None, reason
    cc = c_compiler()
    if cc is None:
        return None, "its kernel is built by the machine's C compiler, and none was found (cc, gcc, or $CC)"
    digest = hashlib.sha256("\0".join((C_SOURCE, cc, *CFLAGS)).encode()).hexdigest()[:16]
    try:
        where = cache_dir() / "kernels" / digest
    except CacheDirError:  # no cache of the user's: a directory of this process's own (never a shared, guessable one)
        where = Path(tempfile.mkdtemp(prefix="vramplan-kernel-"))
    lib = where / LIBRARY
    if not lib.is_file():
        try:
            where.mkdir(parents=True, exist_ok=True)
            # written and built under this process's names, the library renamed into place: a concurrent build never
            # reads a half-written source or loads a half-written library
            src = where / f".w4a8.{os.getpid()}.c"
            src.write_text(C_SOURCE)
            partial = where / f".{LIBRARY}.{os.getpid()}"
            done = subprocess.run([*shlex.split(cc), *CFLAGS, str(src), "-o", str(partial)], capture_output=True,
                                  text=True, timeout=300)
            src.unlink(missing_ok=True)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no message"])[0]
                return None, f"its kernel did not build with {cc}: {first}"
            os.replace(partial, lib)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"its kernel could not be built in {where}: {exc}"
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as exc:
        return None, f"its kernel did not load: {exc}"
    dll.w4a8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    dll.w4a8_linear.restype = ctypes.c_int
    return dll, None


def unavailable() -> str | None:
    """Why cpu-w4a8's kernel cannot run here (building it at the first call), or None when it can."""
    return _load()[1]


def _kernel():
    dll, reason = _load()
    if dll is None:
        raise RuntimeError(f"cpu-w4a8: {reason}")
    return dll.w4a8_linear


def w4a8_mm(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [m, in] (fp32 or bf16, on the CPU) times the matrix (codes [out, in / 2], scale_zeros [out, in / group, 2]):
    [m, out] in x's dtype. A decode step calls it about 7 times a layer: it does no more than the call needs."""
    if x.dtype is torch.bfloat16:
        bf16 = 1
    elif x.dtype is torch.float32:
        bf16 = 0
    else:
        x, bf16 = x.float(), 0
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    if k != 2 * codes.shape[1] or k % group or group % 32 or codes.dtype is not torch.uint8 \
            or scale_zeros.dtype is not torch.bfloat16 or scale_zeros.shape != (codes.shape[0], k // group, 2) \
            or not (x.is_cpu and codes.is_contiguous() and scale_zeros.is_contiguous()):
        raise ValueError(f"cpu-w4a8: a [{m}, {k}] input does not fit codes {tuple(codes.shape)} {codes.dtype} and "
                         f"scales {tuple(scale_zeros.shape)} {scale_zeros.dtype} in groups of {group}")
    out = torch.empty(m, codes.shape[0], dtype=x.dtype)
    if _kernel()(x.data_ptr(), bf16, codes.data_ptr(), scale_zeros.data_ptr(), out.data_ptr(), bf16, m,
                 codes.shape[0], k, group):
        raise MemoryError(f"cpu-w4a8: no memory for the quantized inputs of a {m} x {k} product")
    return out


@torch.library.custom_op("vramplan::w4a8_linear", mutates_args=())
def _w4a8_op(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """w4a8_mm as a custom op, which torch.compile calls as it is (ctypes is not traceable)."""
    return w4a8_mm(x, codes, scale_zeros, group)


@_w4a8_op.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    return x.new_empty(x.shape[0], codes.shape[0], dtype=dtype)


def product(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """w4a8_mm, through the custom op inside a compiled graph."""
    if torch.compiler.is_compiling():
        return _w4a8_op(x, codes, scale_zeros, group)
    return w4a8_mm(x, codes, scale_zeros, group)


def quantize_matrix(weight: torch.Tensor, group: int = CPU_W4A8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] matrix in the kernel's layout on the CPU: (codes [out, in / 2], bf16 scale and zero
    [out, in / group, 2]), quantized ROWS_PER_BLOCK rows at a time in fp32 (no full-size temporary)."""
    out_features, in_features = weight.shape
    codes = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    scale_zeros = torch.empty(out_features, in_features // group, 2, dtype=torch.bfloat16)
    for start in range(0, out_features, ROWS_PER_BLOCK):
        rows = slice(start, start + ROWS_PER_BLOCK)
        block, sz = group_quantize(weight[rows].to("cpu", torch.float32), group)
        codes[rows] = pack_codes(block)
        scale_zeros[rows] = sz.transpose(0, 1)
    return codes, scale_zeros


def dequantize(codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The [out, in] matrix of the layout, in fp32."""
    sz = scale_zeros.float().repeat_interleave(group, dim=1)
    return (unpack_codes(codes).float() - 8) * sz[..., 0] + sz[..., 1]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [n, k] (k a multiple of 32) -> the kernel's bytes [n, k / 2]: each 32 codes as 16 bytes, codes
    0-15 in the low nibbles, 16-31 in the high."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """pack_codes undone: [n, k / 2] bytes -> int32 codes [n, k]."""
    n, half = packed.shape
    p = packed.reshape(n, half // 16, 1, 16)
    return torch.cat([p & 0x0F, p >> 4], dim=2).reshape(n, 2 * half).to(torch.int32)


class W4A8Linear(nn.Module):
    """A linear in cpu-w4a8's layout (see the module docstring), multiplied by the kernel; the bias, if any, as
    loaded."""

    def __init__(self, codes: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, half = codes.shape
        self.in_features, self.group_size = 2 * half, group_size
        self.register_buffer("codes", codes)
        self.register_buffer("scale_zeros", scale_zeros)
        self.register_buffer("bias", bias)  # (a buffer, so that the run's byte count sees it)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = CPU_W4A8_GROUP) -> "W4A8Linear":
        codes, scale_zeros = quantize_matrix(linear.weight.detach(), group_size)
        bias = linear.bias.detach().cpu() if linear.bias is not None else None
        return cls(codes, scale_zeros, group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = product(x.reshape(-1, self.in_features), self.codes, self.scale_zeros, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype is x.dtype else out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The [out, in] matrix whose product the kernel computes (before the inputs are quantized), in fp32."""
        return dequantize(self.codes, self.scale_zeros, self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of "
                f"{self.group_size} x int8 inputs (vramplan's CPU kernel)")


def quantize_linears(module: nn.Module, group_size: int = CPU_W4A8_GROUP) -> int:
    """Every plain nn.Linear of `module` but lm_head whose shape the kernel takes, replaced by a W4A8Linear on the CPU;
    returns how many."""
    return replace_linears(module, lambda m: W4A8Linear.from_linear(m, group_size)
                           if w4a8_packs(m.out_features, m.in_features) else None)
