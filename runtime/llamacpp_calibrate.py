"""`vramplan calibrate --engine llama.cpp`: llama.cpp's efficiencies fitted to llama-server runs on this machine.

For each GGUF file (with the model it was converted from, for its shapes) llama.cpp's plan for the file's type is run
with llama-server (runtime.llamacpp_run: the command `plan --emit llama.cpp` writes) at each prompt length, a random
prompt of token ids generated to the end, and llama-server's own timings are kept: the prompt's time and the time
per generated token. planner.engines.llamacpp.fit_llamacpp fits them (weights per GGUF file type, attention on the
f16 cache) into the profile's calibration, as `bench/llamacpp_serve.py --fit` does by hand with files it builds
itself. llama.cpp plans on that profile use them (their speed source says "calibrated"). CPU profiles only (the fit's
CPU model: every layer on the CPU).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vramplan.planner.errors import VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.request import Request

from .llamacpp_run import file_type_of, plan_for_file, read_checked, run_llamacpp

DEFAULT_PROMPTS = (64, 256)
DEFAULT_NEW_TOKENS = 16


@dataclass(kw_only=True)
class LlamaCppCalibration:
    profile: HardwareProfile
    runs: list[dict] = field(default_factory=list)  # one per request: file, type, prompt, timings
    warnings: list[str] = field(default_factory=list)
    commit: str = ""


def server_version(server: Path) -> str:
    """llama-server's `--version` line ("version: 1 (0c1e570)"), or "unknown"."""
    try:
        r = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "unknown"


def calibrate_llamacpp(hw: HardwareProfile, pairs: list[tuple[object, str]], server: Path, *,
                       prompts: tuple[int, ...] = DEFAULT_PROMPTS, new_tokens: int = DEFAULT_NEW_TOKENS,
                       threads: int | None = None, say: Callable[[str], None] = lambda _: None) -> LlamaCppCalibration:
    """Run every (model spec, GGUF path) at every prompt length and fit llama.cpp's entries into `hw`."""
    from vramplan.planner.engines.llamacpp_fit import ServerRun, fit_llamacpp

    if hw.has_gpu:
        raise VramplanError(f"calibrate --engine llama.cpp fits CPU runs (every layer on the CPU): {hw.name} has a "
                            "GPU; calibrate a CPU profile")
    if not pairs:
        raise VramplanError("calibrate --engine llama.cpp needs --gguf files (and --models, the models they were "
                            "converted from)")
    if new_tokens < 2:
        raise VramplanError(f"calibration needs at least 2 new tokens per run, got {new_tokens}")
    headers = read_checked(pairs)  # every file is its model's, before any server starts
    commit = server_version(server)
    runs, records, warnings = [], [], []
    for (spec, gguf), header in zip(pairs, headers):
        file_type = file_type_of(header)
        for prompt in prompts:
            req = Request(context=prompt + new_tokens, prompt_tokens=prompt, engine="llama.cpp")
            p = plan_for_file(spec, hw, req, gguf, new_tokens, prompt_given=True, header=header)
            if not p.fits:
                warnings.append(f"{Path(gguf).name} at a {prompt}-token prompt does not fit {hw.name}: "
                                f"{p.reasons[0] if p.reasons else 'nothing fits'}")
                continue
            say(f"{Path(gguf).name} ({file_type}), prompt {prompt}: llama-server")
            r = run_llamacpp(p, spec, hw, gguf, server, prompt_text=None, prompt_tokens=prompt,
                             max_new_tokens=new_tokens, temperature=0.0, seed=0, threads=threads)
            m = r.measured
            if not (m.decode_tokens_per_s and m.prefill_tokens_per_s and r.prompt_tokens):
                warnings.append(f"{Path(gguf).name} at a {prompt}-token prompt: llama-server gave no timings")
                continue
            prefill_s = r.prompt_tokens / m.prefill_tokens_per_s
            runs.append(ServerRun(spec=spec, file_type=file_type, kv_type=p.choice.kv_dtype, prompt=r.prompt_tokens,
                                  new_tokens=m.generated_tokens or new_tokens,
                                  decode_s_per_token=1.0 / m.decode_tokens_per_s, prefill_s=prefill_s))
            records.append({"gguf": str(gguf), "model": spec.name, "file_type": file_type,
                            "kv_type": p.choice.kv_dtype, "prompt_tokens": r.prompt_tokens,
                            "new_tokens": m.generated_tokens, "decode_tokens_per_s": m.decode_tokens_per_s,
                            "prefill_tokens_per_s": m.prefill_tokens_per_s, "peak_ram_bytes": m.peak_ram_bytes,
                            "threads": threads or os.cpu_count()})
            say(f"  decode {m.decode_tokens_per_s:.2f} tok/s, prompt {m.prefill_tokens_per_s:.1f} tok/s")
    if not runs:
        raise VramplanError("no llama-server run gave timings, nothing to fit: " + "; ".join(warnings))
    fitted, fit_warnings = fit_llamacpp(hw, runs, commit=commit, measured_at=dt.date.today().isoformat())
    return LlamaCppCalibration(profile=fitted, runs=records, warnings=warnings + list(fit_warnings), commit=commit)
