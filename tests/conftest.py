"""Shared fixtures: tiny models of each supported architecture, built from configs and saved
with ``save_pretrained`` (safetensors) so that tests run the real loading path.

torch and transformers are imported inside the helpers, never at module level: the
planner's tests must be able to check that importing the planner pulls in no torch.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from vramplan.planner.quant import SCHEMES

# hidden 64, 2 layers, GQA 2:1 with head_dim 32 (quanto's KV groups of 64 need
# heads x head_dim to be a multiple of 64), intermediate 256 so that a down_proj has
# in_features 256 and quanto int4 takes its group-128 path, as in real models.
TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Per architecture: what differs from TINY_COMMON (None removes a key). Sliding windows
# are made small (8) so that prompts of a few dozen tokens cross them.
TINY_ARCHS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 8},
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 32},
    "phi3": {"head_dim": None},  # phi3 derives head_dim = hidden / heads = 32
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
FULL_ATTENTION_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "mixtral")


# The CPU-only shipped profile the runtime tests plan with: plans made with it run on this machine's CPU whatever it is.
RUN_PROFILE = "cpu-ddr5-desktop"


@functools.cache
def run_profile() -> str:
    """RUN_PROFILE within this machine, as `vramplan run --hardware` accepts it (cli_inputs.run_hardware): its speed
    constants, so a test's plan does not depend on this machine's probe, with at most this machine's RAM. A YAML path
    in a directory of its own, written once per test session."""
    import yaml

    from vramplan.runtime.probe.host import read_host

    root = Path(__file__).resolve().parents[1]
    d = yaml.safe_load((root / "profiles" / f"{RUN_PROFILE}.yaml").read_text())
    d["name"] = f"{RUN_PROFILE}-here"
    d["host"]["ram"] = f"{min(read_host().effective_ram_bytes, 64 << 30) // (1 << 20)} MiB"
    path = Path(tempfile.mkdtemp(prefix="vramplan-tests-")) / f"{d['name']}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def tiny_config_dict(arch: str, **overrides) -> dict:
    """A tiny config of ``arch`` as a plain dict with its model_type (what a catalog holds)."""
    values = {**TINY_COMMON, **TINY_ARCHS[arch], **overrides}
    return {"model_type": arch, **{k: v for k, v in values.items() if v is not None}}


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    values = tiny_config_dict(arch, **overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def compiled_and_eager_tokens(model, prompt_tokens: int, new_tokens: int, device: str = "cpu"):
    """The greedy tokens of a compiled decode (runtime.compiled.StaticDecoder, warmed up first) and of eager decode,
    from one synthetic prompt, chunks of 8."""
    import torch

    from vramplan.runtime.compiled import StaticDecoder
    from vramplan.runtime.generate import generate, synthetic_prompt, warm_up

    prompt = synthetic_prompt(prompt_tokens, 512, seed=4).to(device)
    eager = generate(model, prompt, max_new_tokens=new_tokens, prefill_chunk=8)
    static = StaticDecoder(model, max_len=prompt_tokens + new_tokens, device=torch.device(device))
    warm_up(model, prompt, 8, static=static)
    return generate(model, prompt, max_new_tokens=new_tokens, prefill_chunk=8, static=static).tokens, eager.tokens


def assert_compiled_steps_near_eager(model, steps: int) -> None:
    """Eager steps (a DynamicCache) of a 16-token prompt's greedy tokens, and the compiled step (runtime.compiled's
    static decoder) fed the same tokens: each step's logits within 5 % of the largest."""
    import torch
    from transformers import DynamicCache

    from vramplan.runtime.compiled import StaticDecoder
    from vramplan.runtime.generate import synthetic_prompt

    prompt = synthetic_prompt(16, 512, seed=4)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        eager = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1].float()]
        for _ in range(steps):
            token = eager[-1].argmax().view(1, 1)
            eager.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1].float())
        static = StaticDecoder(model, max_len=16 + steps + 2, device=torch.device("cpu"))
        static.static_forward(prompt, 0)
        compiled = [static.static_decode(e.argmax().view(1, 1), 16 + i)[0] for i, e in enumerate(eager[:-1])]
    for e, c in zip(eager[1:], compiled):
        assert (e - c).abs().max() < 0.05 * e.abs().max()


def save_tiny_model(config, path: Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Build ``config``'s causal LM with transformers' own init (seeded) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _private_probe_cache(tmp_path_factory):
    """The suite never writes the user's cache: this machine's quick probe (taken while the suite keeps the machine
    busy) goes to a directory of the session's, for its subprocesses too. A test may still point it elsewhere."""
    patch = pytest.MonkeyPatch()
    patch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("vramplan-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """arch -> a directory holding a saved tiny bf16 checkpoint (config.json + model.safetensors)."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    return {arch: save_tiny_model(tiny_config(arch), root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def load_tiny(tiny_checkpoints):
    """load_tiny(arch, weight_quant, compute_dtype="bf16") -> LoadedModel, each loaded once per session."""
    from vramplan.runtime.load import load_model

    cache: dict[tuple[str, str, str], object] = {}

    def load(arch: str, weight_quant: str, compute_dtype: str = "bf16"):
        key = (arch, weight_quant, compute_dtype)
        if key not in cache:
            cache[key] = load_model(tiny_checkpoints[arch], scheme=SCHEMES[weight_quant], compute_dtype=compute_dtype)
        return cache[key]

    return load


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is visible."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
