"""What the machine a GPU proof runs on has: Python, the packages vramplan uses (missing ones named), the GPU and its
driver (torch and nvidia-smi). Prints JSON; the first step of bench/gpu_validate.py, so that every result of a device
call can say what it ran on."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys

PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "optimum-quanto", "huggingface-hub", "safetensors",
            "typer", "rich", "pyyaml", "psutil", "nvidia-ml-py", "matplotlib", "pytest", "llama-cpp-python")


def main() -> None:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "packages": versions,
           "missing": [n for n, v in versions.items() if v is None]}
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = {"name": props.name, "total_memory_bytes": props.total_memory,
                          "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                          "count": torch.cuda.device_count()}
    except Exception as e:  # noqa: BLE001 - reported, not raised: this step describes the machine
        out["torch_error"] = f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                            "pcie.link.width.max,clocks.max.sm,clocks.max.mem,power.limit", "--format=csv"],
                           capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    out["cpu_count"] = __import__("os").cpu_count()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
