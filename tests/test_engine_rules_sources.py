"""Engine rules read in the engines' own sources: Ollama v0.32.15 (b7871fc0) caps num_ctx at the training context
(llm/server.go NewLlamaServer), runs some families with one slot (server/sched.go Scheduler.load) and turns flash
attention off on old CUDA GPUs (ml/device.go FlashAttentionSupported); vLLM 0.33.0 (4ba787ec9) refuses a TP size that
does not divide the vocabulary padded to 64 (vocab_parallel_embedding.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramplan.planner.architectures import spec_from_config
from vramplan.planner.engines import ollama
from vramplan.planner.engines import vllm_rules as rules
from vramplan.planner.errors import PlanError
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec
from vramplan.planner.units import GiB

RTX4090 = resolve_profile("rtx-4090")[0]
# A Maxwell card (compute capability 5.2) and a Jetson Xavier's (7.2): Ollama turns flash attention off on both.
MAXWELL = RTX4090.replace(name="maxwell-24gb", gpus=(replace(RTX4090.gpus[0], compute_capability="5.2"),))
XAVIER = RTX4090.replace(name="cc72", gpus=(replace(RTX4090.gpus[0], compute_capability="7.2"),))
PASCAL_8GB = RTX4090.replace(name="pascal-8gb", gpus=(replace(RTX4090.gpus[0], compute_capability="5.0",
                                                               memory_bytes=8 * GiB),))


# ---------------------------------------------------------------- Ollama: num_ctx capped at the training context
def test_ollama_caps_num_ctx_at_the_training_context():
    """Qwen2.5-0.5B: max_position_embeddings 32768 (the GGUF's context_length). Asked 65536 (the overflow allowed),
    Ollama lowers num_ctx to 32768 before it starts llama-server: the plan, the Modelfile and the llama-server argv
    are at 32768, and the notes say so."""
    spec = model_spec("qwen2.5-0.5b")
    assert spec.max_context == 32768
    req = Request(context=65536, allow_context_overflow=True)
    launch = ollama.ollama_launch(spec, RTX4090, req, "Q4_K_M")
    assert launch.num_ctx == 32768 and launch.argv("x.gguf", "f16")[3:5] == ["-c", "32768"]
    p = ollama.plan_ollama(spec, RTX4090, req)
    assert p.request.context == 32768
    assert any(w.startswith("num_ctx 65536 capped at 32768: Ollama lowers") for w in p.warnings)
    e = ollama.export_ollama(spec, RTX4090, p)
    assert "PARAMETER num_ctx 32768" in e.text and e.details["num_ctx"] == 32768
    assert any("requested context size too large for model" in n for n in e.notes)


def test_ollama_keeps_a_context_within_training():
    spec = model_spec("qwen2.5-0.5b")
    p = ollama.plan_ollama(spec, RTX4090, Request(context=8192))
    assert p.request.context == 8192 and not any("capped at" in w for w in p.warnings)


# ---------------------------------------------------------------- Ollama: single-slot families
@pytest.mark.parametrize("model_type,family", [("qwen3_next", "qwen3next"), ("qwen3_5_moe", "qwen35moe"),
                                               ("lfm2", "lfm2"), ("nemotron_h", "nemotron_h"),
                                               ("mllama", "mllama")])
def test_ollama_single_slot_families(model_type, family):
    """server/sched.go Scheduler.load: numParallel = 1 for these families whatever OLLAMA_NUM_PARALLEL says."""
    spec = replace(model_spec("qwen2.5-0.5b"), model_type=model_type)
    assert ollama.ollama_family(spec) == family
    assert ollama.num_parallel(spec, 4) == 1


def test_ollama_single_slot_in_the_launch(monkeypatch):
    """The launch of a single-slot family has one slot: -c num_ctx -np 1 (vramplan has no GGUF mapping for these
    families yet, so the GGUF's size is stubbed)."""
    spec = replace(model_spec("qwen2.5-0.5b"), model_type="qwen3_next")
    monkeypatch.setattr(ollama, "gguf_file_bytes", lambda s, ft: 1 * GiB)
    launch = ollama.ollama_launch(spec, RTX4090, Request(context=4096, batch=4), "Q8_0")
    assert launch.num_parallel == 1 and launch.argv("x.gguf", "f16")[3:7] == ["-c", "4096", "-np", "1"]
    req, warnings = ollama.OLLAMA.check(spec, RTX4090, Request(context=4096, batch=4, engine="ollama"))
    assert req.batch == 1 and any(w.startswith("one slot: Ollama runs the qwen3next family") for w in warnings)


def test_ollama_other_families_keep_their_slots():
    spec = model_spec("qwen2.5-0.5b")
    assert ollama.num_parallel(spec, 4) == 4
    assert ollama.ollama_launch(spec, RTX4090, Request(context=4096, batch=4), "Q8_0").num_parallel == 4


# ---------------------------------------------------------------- Ollama: flash attention by compute capability
def test_ollama_flash_attention_by_compute_capability():
    """ml/device.go cudaFlashAttentionSupported: CUDA below 6.0, or 7.2, is without flash attention."""
    assert ollama.flash_attention(RTX4090) == "auto"
    assert ollama.flash_attention(MAXWELL) == "off" and ollama.flash_attention(XAVIER) == "off"
    assert ollama.flash_attention(RTX4090.replace(gpus=(replace(RTX4090.gpus[0], compute_capability="6.0"),))) == "auto"
    assert ollama.flash_attention(resolve_profile("apple-m4-max-128gb")[0]) == "auto"  # Metal


def test_ollama_without_flash_attention_plans_only_f16():
    """--flash-attn off, so llama.cpp refuses a quantized V cache: no q8_0 / q4_0 candidate, the argv says off, and
    num_batch is 512 (automaticGenerationBatch with flash attention off on CUDA)."""
    spec = model_spec("qwen2.5-0.5b")
    p = ollama.plan_ollama(spec, MAXWELL, Request(context=32768))
    assert p.fits and {c.kv_dtype for c in p.candidates} == {"f16"}
    assert any(w.startswith("--flash-attn off: Ollama deems flash attention unsupported on compute capability 5.2")
               for w in p.warnings)
    e = ollama.export_ollama(spec, MAXWELL, p)
    argv = e.details["llama_server_argv"]
    assert argv[argv.index("--flash-attn") + 1] == "off" and e.details["num_batch"] == 512
    assert "--cache-type-v" not in argv
    with pytest.raises(PlanError, match="refuses a quantized V cache"):
        ollama.plan_ollama(spec, MAXWELL, Request(context=4096, kv_dtype=("q8_0",), engine="ollama"))
    # with flash attention (the same GPU at 8.9) all three caches are planned and num_batch is 2048 at 32k
    q = ollama.plan_ollama(spec, RTX4090, Request(context=32768))
    assert {c.kv_dtype for c in q.candidates} == {"f16", "q8_0", "q4_0"}


def test_ollama_without_flash_attention_on_a_small_gpu_takes_256():
    """sched.go constrainedCUDAWithoutFlashAttention: above 4096 tokens on a CUDA GPU of at most 8 GiB: 256."""
    spec = model_spec("qwen2.5-0.5b")
    assert ollama.ollama_launch(spec, PASCAL_8GB, Request(context=8192), "Q8_0").num_batch == 256
    assert ollama.ollama_launch(spec, PASCAL_8GB, Request(context=4096), "Q8_0").num_batch == 512
    assert ollama.auto_num_batch(8192, 0, 0) == 1024  # flash attention not off: the context decides


# ---------------------------------------------------------------- vLLM: TP must divide the padded vocabulary
def test_vllm_tp_must_divide_the_padded_vocabulary():
    """vocab_parallel_embedding.py: pad_vocab_size pads to a multiple of 64 (not 64 x tp), then
    divide(num_embeddings_padded, tp_size) asserts. A llama config with 15 heads, 5 KV heads, intermediate 2560 and
    vocabulary 49152 (= 64 x 768): TP 5 divides the heads, the KV heads and the MLP, but 49152 % 5 == 2."""
    cfg = dict(model_type="llama", hidden_size=960, num_attention_heads=15, num_key_value_heads=5,
               intermediate_size=2560, num_hidden_layers=2, vocab_size=49152, max_position_embeddings=8192,
               tie_word_embeddings=True)
    spec = spec_from_config(cfg, name="tiny-15-heads")
    assert rules.vocab_sizes(spec) == {49152} and rules.padded_vocab(49152) == 49152
    assert rules.tp_refusal(spec, 5) == ("the vocabulary (49152, padded to 49152) is not divisible by 5: vLLM pads "
                                         "it to a multiple of 64 only, then shards it evenly")
    assert rules.tp_refusal(spec, 1) == ""
    assert rules.tp_sizes(spec, 8) == [1]  # 3: KV heads 5; 5: the vocabulary; 2, 4, 6, 7, 8: the 15 heads
    # the padding: 32001 rows -> 32064 (= 64 x 501 = 2^6 x 3 x 167): TP 3 divides it, TP 5 does not
    assert rules.padded_vocab(32001) == 32064 and 32064 % 3 == 0
    odd = spec_from_config({**cfg, "vocab_size": 32001}, name="tiny-32001")
    assert rules.vocab_sizes(odd) == {32001}
    assert rules.tp_refusal(odd, 5).startswith("the vocabulary (32001, padded to 32064) is not divisible by 5")
    # each rank holds padded / tp rows: 32064 / 3 = 10688 of the 32001
    emb = next(t for t in odd.tensors if t.role.name == "EMBEDDING")
    assert rules.tp_fraction(odd, emb, 3) == pytest.approx(10688 / 32001)


def test_vllm_tp_sizes_of_real_models_unchanged():
    """Power-of-two TP sizes always divide a vocabulary padded to 64: the shipped models keep their TP sizes."""
    assert rules.tp_sizes(model_spec("qwen2.5-32b"), 8) == [1, 2, 4, 8]
    assert rules.tp_refusal(model_spec("qwen2.5-0.5b"), 2) == ""
