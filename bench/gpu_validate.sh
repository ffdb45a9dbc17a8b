#!/usr/bin/env bash
# The GPU proof in one command: install what the GPU machine lacks from the wheels carried in .whl/
# (bitsandbytes 0.50.2 with its CUDA 13 library, optimum-quanto 0.2.7; no internet there), then run the
# steps of bench/gpu_validate.py (probe, calibrate, accuracy, offload vs accelerate, induced OOM), each in its
# own process, continuing past a failed one. `--cpu-smoke` runs the same steps, tiny, on a CPU machine.
# Arguments go to bench/gpu_validate.py (--steps, --work, --machine, --budget-s); see its docstring.
set -u
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vramplan-site \
        .whl/*.whl || { echo "gpu_validate: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH="/tmp/vramplan-site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 bench/gpu_validate.py "$@"
