#!/usr/bin/env bash
# Is eager GPU decode speed stable from one process to the next? Runs the same decode-step profile (Llama-3.2-1B
# bf16, SDPA) in N fresh processes, then N with OMP_NUM_THREADS=1; records the
# GPU clocks and the host load between them. Usage: bench/host_variance.sh OUTDIR [N]
set -u
cd "$(dirname "$0")/.."
out=${1:?outdir}; n=${2:-4}
mkdir -p "$out"
log="$out/host-variance.txt"
stamp() { echo "== $* $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$log";
          nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader >> "$log" 2>&1; }
for i in $(seq 1 "$n"); do
  stamp "1b bf16 sdpa, process $i"
  timeout 60 python3 bench/decode_profile.py --model llama-3.2-1b --quants bf16 --attn sdpa --steps 30 \
      --machine "gpu-p$i" --out "$out" > /dev/null 2>> "$log"
done
for i in $(seq 1 "$n"); do
  stamp "1b bf16 sdpa, OMP_NUM_THREADS=1, process $i"
  OMP_NUM_THREADS=1 timeout 60 python3 bench/decode_profile.py --model llama-3.2-1b --quants bf16 --attn sdpa \
      --steps 30 --machine "gpu-omp1-p$i" --out "$out" > /dev/null 2>> "$log"
done
python3 - "$out" >> "$log" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("decode-profile-gpu-*.json")):
    for r in json.loads(f.read_text())["rows"]:
        print(f.stem, "error" if "error" in r else
              f"step {r['step_ms_median']:.2f} ms (min {r['step_ms_min']:.2f}), CPU busy {r['cpu_busy_ms_per_step']:.2f},"
              f" GPU busy {r['gpu_busy_ms_per_step']:.2f}, prefill {r['prefill_ms']}")
PY
cat "$log"
