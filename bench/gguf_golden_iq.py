"""Extend tests/data/gguf_golden.json with the file types llama-quantize makes only with an importance matrix (IQ1-IQ3,
Q2_K_S), the TQ and MXFP4_MOE types, and two gpt_oss cases (bf16, and its experts stored MXFP4 as openai ships them),
from llama.cpp itself (not run by CI; the tests read its output).

Same procedure as bench/gguf_golden.py, plus an importance matrix (legacy .dat, every value 1.0, one per row element
and expert: the types do not depend on its values) for the file types llama-quantize refuses without one. Each case is
written to <work>/case-NAME.json as it finishes (an interrupted run resumes), then merged:

    python bench/gguf_golden_iq.py --llama-cpp DIR --quantize DIR/build/bin/llama-quantize --work /tmp/golden
"""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed
import gguf_golden as G  # noqa: E402
from vramplan.planner.gguf import GGUF_FILE_TYPES  # noqa: E402

LLAMA = Path(".")  # set by main: the llama.cpp source tree
QUANT = Path("llama-quantize")  # set by main
WORK = Path(".")  # set by main: where each finished case is kept
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S")
GPT_OSS = dict(model_type="gpt_oss", hidden_size=512, intermediate_size=512, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
               num_experts_per_tok=4, vocab_size=1024, sliding_window=128, tie_word_embeddings=False)


def write_imatrix(f16: Path, out: Path) -> None:
    sys.path.insert(0, str(LLAMA / "gguf-py"))
    from gguf import GGUFReader
    r = GGUFReader(f16)
    entries = []
    for t in r.tensors:
        shape = [int(d) for d in t.shape]
        if len(shape) >= 2 and t.name.endswith(".weight"):
            n = shape[0] * (shape[2] if len(shape) > 2 else 1)
            entries.append((t.name, n))
    with open(out, "wb") as fh:
        fh.write(struct.pack("<i", len(entries)))
        for name, n in entries:
            b = name.encode()
            fh.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", 1, n) + struct.pack(f"<{n}f", *([1.0] * n)))
        fh.write(struct.pack("<i", 1))


def quantize(src, out, ft, imatrix=None):
    cmd = [str(QUANT)] + (["--imatrix", str(imatrix)] if imatrix else []) + [str(src), str(out), ft, "2"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{ft} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def mxfp4_checkpoint(model_dir: Path) -> None:
    """Turn a saved bf16/f32 gpt_oss checkpoint into the MXFP4 layout openai ships (experts as _blocks/_scales)."""
    import torch
    from safetensors.torch import load_file, save_file
    files = list(model_dir.glob("*.safetensors"))
    assert len(files) == 1
    sd = load_file(files[0])
    g = torch.Generator().manual_seed(0)
    new = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            e, i, o = v.shape  # transformers [E, in, out]; the checkpoint stores [E, out, in/32, 16] + [E, out, in/32]
            new[k + "_blocks"] = torch.randint(0, 256, (e, o, i // 32, 16), dtype=torch.uint8, generator=g)
            new[k + "_scales"] = torch.randint(118, 130, (e, o, i // 32), dtype=torch.uint8, generator=g)
        else:
            new[k] = v
    files[0].unlink()
    save_file(new, model_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    idx = model_dir / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()


def case(name, config_kwargs, file_types, work: Path, existing=None, mxfp4=False):
    model_dir = work / name
    config = G.save_tiny_model(config_kwargs, model_dir)
    if mxfp4:
        mxfp4_checkpoint(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
    f16 = work / f"{name}-f16.gguf"
    G.convert(LLAMA, model_dir, f16)
    imatrix = work / f"{name}.imatrix.dat"
    write_imatrix(f16, imatrix)
    tensors = existing["tensors"] if existing else None
    per_type = dict(existing["file_types"]) if existing else {}
    for ft in file_types:
        out = work / f"{name}-{ft}.gguf"
        if ft in ("F16", "BF16"):  # convert_hf_to_gguf.py --outtype (as bench/gguf_golden.py's llama-quantize F16/BF16)
            quantize(f16, out, ft)
        else:
            quantize(f16, out, ft, imatrix if ft in NEEDS_IMATRIX else None)
        read = G.read_file(LLAMA, out)
        out.unlink()
        if tensors is not None and read["tensors"] != tensors:
            raise RuntimeError(f"{name} {ft}: tensors differ")
        tensors = read.pop("tensors")
        per_type[ft] = read
        print(name, ft, "ok", flush=True)
    return {"config": existing["config"] if existing else config, "tensors": tensors,
            "file_types": {ft: per_type[ft] for ft in GGUF_FILE_TYPES if ft in per_type}}


def main():
    global LLAMA, QUANT, WORK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--quantize", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    LLAMA, QUANT, WORK = a.llama_cpp, a.quantize, a.work
    WORK.mkdir(parents=True, exist_ok=True)
    golden_path = ROOT / "tests" / "data" / "gguf_golden.json"
    golden = json.loads(golden_path.read_text())
    names = a.cases or list(golden["cases"]) + ["gpt_oss", "gpt_oss_mxfp4"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in names:
            done = WORK / f"case-{name}.json"
            if done.exists():
                golden["cases"][name] = json.loads(done.read_text())
                print(name, "cached", flush=True)
                continue
            if name in G.CASES:
                have = golden["cases"][name]
                missing = [ft for ft in GGUF_FILE_TYPES if ft not in have["file_types"]]
                golden["cases"][name] = case(name, G.CASES[name], missing, work, have)
            else:
                mxfp4 = name == "gpt_oss_mxfp4"  # llama-quantize refuses to requantize MXFP4 to any other type
                golden["cases"][name] = case(name, GPT_OSS, ["F16", "MXFP4_MOE"] if mxfp4 else list(GGUF_FILE_TYPES),
                                             work, mxfp4=mxfp4)
            done.write_text(json.dumps(golden["cases"][name], separators=(",", ":")))
    golden_path.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {golden_path}")


if __name__ == "__main__":
    main()
