"""Golden GGUF tensor types from llama.cpp itself, for tests/test_gguf.py (not run by CI).

For each small random-weight transformers model below (dimensions chosen to hit the rules:
GQA >= 4, 8 experts, tied embeddings, rows not divisible by 256 or by 32, 80 layers for the
LLM_TYPE_70B bump, MLA, fused phi3 projections), this script
1. saves the model with transformers (random init, float32),
2. converts it with llama.cpp's convert_hf_to_gguf.py --outtype f16 (the tokenizer is skipped:
   llama-quantize reads no vocabulary, and sizing is about tensors),
3. runs `llama-quantize <f16.gguf> <out.gguf> <TYPE>` for every file type planner.gguf knows,
4. reads each output back with gguf-py's GGUFReader and records every tensor's name, shape and
   ggml type, the tensors' bytes and the bytes of the data section (with alignment padding).

It needs a llama.cpp source tree (for convert_hf_to_gguf.py, conversion/ and gguf-py/) and a
llama-quantize binary built from that same tree; both are given by path, nothing is built here.

    python bench/gguf_golden.py --llama-cpp DIR --quantize DIR/build/bin/llama-quantize \
        --out tests/data/gguf_golden.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from vramplan.planner.gguf import GGUF_FILE_TYPES  # noqa: E402

# Small models, every dimension a multiple of 256 unless the case tests the fallback.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CASES: dict[str, dict] = {
    # GQA 4, llama3 RoPE (rope_freqs), untied output, 8 layers for use_more_bits
    "llama": dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False,
                  rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, max_position_embeddings=131072),
    # tied embeddings (token_embd takes output's rules), no GQA, ffn_down rows of 320: Q*_K -> fallback
    "llama_tied_320": dict(model_type="llama", hidden_size=512, intermediate_size=320, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                           tie_word_embeddings=True),
    # 80 layers: LLM_TYPE_70B moves attn_v from Q3_K/Q4_K to Q5_K
    "llama_80_layers": dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=80,
                            num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                            tie_word_embeddings=False),
    # GQA 8, qkv biases, ffn_down rows of 336 (not a multiple of 32: F16 fallback)
    "qwen2": dict(model_type="qwen2", hidden_size=512, intermediate_size=336, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                  tie_word_embeddings=True),
    # 8 experts: attn_v / attn_k Q8_0, attn_output Q5_K
    "mixtral": dict(model_type="mixtral", hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=1024, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      num_experts=16, num_experts_per_tok=4, vocab_size=1024, tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1024),
    # fused attn_qkv (an attn_v-like tensor) and fused gate_up kept as one ffn_up
    "phi3": dict(model_type="phi3", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False,
                 pad_token_id=0),
    # MLA (attn_k_b rows of 128 -> fallback), shared experts, a dense first layer, exp_probs_b
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                        n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
                        topk_group=1, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, vocab_size=1024, tie_word_embeddings=False,
                        rope_scaling=None),
}

# Run by a fresh interpreter: convert_hf_to_gguf.py's main(), with every model class's set_vocab replaced by the
# SET_VOCAB function put in its place (argv: the llama.cpp tree, then convert_hf_to_gguf.py's arguments).
CONVERT_TEMPLATE = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf, gguf
SET_VOCAB
_get_model_class = convert_hf_to_gguf.get_model_class
def get_model_class(*args, **kwargs):
    cls = _get_model_class(*args, **kwargs)
    cls.set_vocab = set_vocab
    return cls
convert_hf_to_gguf.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""
# The tiny models have no tokenizer, and llama-quantize reads none.
CONVERT_WITHOUT_VOCAB = CONVERT_TEMPLATE.replace("SET_VOCAB", "def set_vocab(self):\n    pass")


def save_tiny_model(config_kwargs: dict, out_dir: Path) -> dict:
    """Random-weight transformers model of this config, saved as safetensors; returns its config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = dict(config_kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return json.loads((out_dir / "config.json").read_text())


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({res.returncode}):\n{res.stderr[-4000:]}")


def convert(llama_cpp: Path, model_dir: Path, out: Path, script: str = CONVERT_WITHOUT_VOCAB) -> None:
    _run([sys.executable, "-c", script, str(llama_cpp), str(model_dir), "--outtype", "f16", "--outfile", str(out)])


def quantize(binary: Path, src: Path, out: Path, file_type: str) -> None:
    _run([str(binary), str(src), str(out), file_type, "2"])


def read_file(llama_cpp: Path, path: Path) -> dict:
    """Every tensor's name, shape (ggml order), ggml type and bytes, and the data section's size."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {
        "tensors": [[t.name, [int(d) for d in t.shape]] for t in reader.tensors],
        "types": " ".join(t.tensor_type.name for t in reader.tensors),
        "tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
        "data_section_bytes": path.stat().st_size - reader.data_offset,
    }


def llama_cpp_commit(llama_cpp: Path) -> str:
    res = subprocess.run(["git", "-C", str(llama_cpp), "rev-parse", "HEAD"], capture_output=True, text=True)
    return res.stdout.strip() or "unknown"


def golden_case(name: str, llama_cpp: Path, binary: Path, work: Path) -> dict:
    """The tensors (names and shapes, the same in every file) and, per file type, their types in that order."""
    model_dir = work / name
    config = save_tiny_model(CASES[name], model_dir)
    f16 = work / f"{name}-f16.gguf"
    convert(llama_cpp, model_dir, f16)
    tensors = None
    per_type = {}
    for file_type in GGUF_FILE_TYPES:
        out = work / f"{name}-{file_type}.gguf"
        quantize(binary, f16, out, file_type)
        read = read_file(llama_cpp, out)
        out.unlink()
        if tensors is not None and read["tensors"] != tensors:
            raise RuntimeError(f"{name} {file_type}: tensor names or shapes differ between file types")
        tensors = read.pop("tensors")
        per_type[file_type] = read
    return {"config": config, "tensors": tensors, "file_types": per_type}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--quantize", type=Path, required=True, help="llama-quantize binary built from that tree")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf_golden.json")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    golden = {"llama_cpp_commit": llama_cpp_commit(args.llama_cpp), "generated_by": "bench/gguf_golden.py",
              "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            print(f"{name} ...", flush=True)
            golden["cases"][name] = golden_case(name, args.llama_cpp, args.quantize, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
