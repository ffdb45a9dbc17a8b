"""Write planner/schemas/*.schema.json: the JSON Schema of each command's --json output, inferred from real outputs of
a spread of requests, then kept (a maintainer's tool, run after a JSON change; tests/test_json_schemas.py checks the
outputs against the shipped files). Run: python tests/make_json_schemas.py

Inference: an object's properties are every key seen, `required` the keys every sample has; a number is "integer" when
every sample is one; maps keyed by data (constant names, speed terms, readings) are objects of any keys whose values
share one schema. Extra keys are allowed: a reader written against version 1 keeps working when one is added."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "planner" / "schemas"
# keys whose objects are maps keyed by data, not records
MAPS = {"constants", "speed_terms", "terms", "workspace_terms", "details", "error_pct", "per_gpu", "weight_bytes",
        "residuals", "versions", "params_by_role", "stored_bytes_by_dtype", "by_dtype", "by_role"}

PLANS = [
    ("llama-3.1-8b", "32k", "rtx-4090", ()), ("llama-3.1-70b", "32k", "rtx-4090", ()),
    ("qwen3-30b-a3b", "32k", "rtx-3060-12gb", ()), ("deepseek-v3", "8k", "rtx-4090", ()),
    ("gpt-oss-120b", "32k", "h100-sxm", ()), ("llama-3.1-8b", "8k", "cpu-ddr5-desktop", ()),
    ("llama-3.1-8b", "32k", "rtx-4090", ("--engine", "llama.cpp")),
    ("mixtral", "8k", "rtx-4090", ("--engine", "ollama")),
    ("qwen2.5-32b", "32k", "rtx-4090", ("--engine", "transformers")), ("llama-3.1-405b", "128k", "rtx-4090", ()),
    ("llama-3.1-70b", "128k", "rtx-3090", ("--prefer", "quality")), ("gemma-2-9b", "8k", "apple-m2-max-96gb", ()),
    ("qwen2.5-14b", "16k", "rtx-4090", ("--prompt-tokens", "512", "--batch", "2", "--quant", "bnb-nf4",
                                        "--kv-dtype", "fp8", "--gpu-layers", "30", "--offload", "stream")),
    ("llama-3.1-70b", "8k", "rtx-3090", ("--gpus", "2", "--vram-budget", "20GiB", "--ram-budget", "48GiB")),
    ("qwen3-30b-a3b", "16k", "rtx-4090", ("--expert-placement", "cpu", "--engine", "llama.cpp")),
    ("qwen2.5-7b", "8k", "a100-80gb-sxm", ("--concurrency",)),
]


def cli_json(*argv) -> dict:
    from vramplan import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main([str(a) for a in argv])
        except SystemExit:
            pass
    return json.loads(buf.getvalue())


def samples() -> dict[str, list]:
    out: dict[str, list] = {"plan": [], "models": [cli_json("models", "--json")], "inspect": [],
                            "profiles-list": [cli_json("profiles", "list", "--json")], "profiles-show": [],
                            "probe": [cli_json("probe", "--quick", "--json")]}
    for model, ctx, hw, extra in PLANS:
        out["plan"].append(cli_json("plan", "--model", model, "--context", ctx, "-H", hw, "--json", *extra))
    for model in ("llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "gemma-3-27b"):
        out["inspect"].append(cli_json("inspect", "--model", model, "--json"))
    for hw in ("rtx-4090", "h200-measured", "apple-m2-ultra-192gb", "cpu-epyc-server"):
        out["profiles-show"].append(cli_json("profiles", "show", hw, "--json"))
    run = cli_json("run", "--model", "qwen2.5-0.5b", "--dummy-weights", "--context", "512", "--prompt-tokens", "32",
                   "--max-new-tokens", "4", "--json")
    out["run"] = [run]
    return out


def kind(x) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", list: "array",
            dict: "object"}[type(x)]


def infer(values: list, key: str = "") -> dict:
    types = {kind(v) for v in values}
    if "number" in types:
        types.discard("integer")
    schema: dict = {"type": sorted(types)[0] if len(types) == 1 else sorted(types)}
    objects = [v for v in values if isinstance(v, dict)]
    if objects:
        if key in MAPS:
            inner = [x for o in objects for x in o.values()]
            schema["additionalProperties"] = infer(inner) if inner else {}
        else:
            keys = list(dict.fromkeys(k for o in objects for k in o))
            schema["properties"] = {k: infer([o[k] for o in objects if k in o], k) for k in keys}
            schema["required"] = [k for k in keys if all(k in o for o in objects)]
    arrays = [v for v in values if isinstance(v, list)]
    items = [x for a in arrays for x in a]
    if arrays and items:
        schema["items"] = infer(items, key)
    return schema


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    OUT.mkdir(exist_ok=True)
    for name, values in samples().items():
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  "$id": f"https://vramplan.dev/schemas/{name}.schema.json",
                  "title": f"vramplan {name.replace('-', ' ')} --json, schema_version 1", **infer(values)}
        (OUT / f"{name}.schema.json").write_text(json.dumps(schema, indent=1) + "\n")
        print(name, len(json.dumps(schema)))


if __name__ == "__main__":
    main()
