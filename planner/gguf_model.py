"""A GGUF file (or the parts of a split one) as the model it holds: the config rebuilt from its metadata, and its
tensors with their exact stored types and bytes.

`read_gguf_model(sources, where)` reads each part's header (planner/gguf_file.py, bounded reads), rebuilds an
HF-style config.json dict from llama.cpp's `{arch}.*` keys and the tensors' shapes, builds the ModelSpec that config
describes (planner/architectures) and checks it tensor by tensor against the file: every tensor planner/gguf.py names
for that spec must be in the file with the same shape, and nothing else. The planner then counts the file's own
tensors (`GGUFModel.tensors`: each one's ggml type and ggml_nbytes as stored) rather than a file type's rules.
`gguf_split_paths(path)` names every part of a split file ("x-00001-of-00003.gguf"); `load_gguf_model(path)` does
both for a local path. Reads only (regular files, opened without blocking); writes nothing.

Sources followed (llama.cpp, as planner/gguf.py): gguf-py/gguf/constants.py (Keys.LLM, Keys.Attention, Keys.Rope,
Keys.Split; MODEL_ARCH_NAMES), convert_hf_to_gguf.py's TextModel.set_gguf_parameters (which HF field each key comes
from: max_position_embeddings -> context_length, intermediate_size -> feed_forward_length, head_dim -> key_length and
value_length, num_local_experts/num_experts -> expert_count, ...), conversion/phi.py (rope.dimension_count,
sliding_window 0 for none), conversion/gpt_oss.py (expert_feed_forward_length, sliding_window), conversion/deepseek.py
(MLA written as MQA: head_count_kv 1, key_length kv_lora_rank + rope, key_length_mla / value_length_mla the per-head
sizes; leading_dense_block_count, expert_shared_count), tools/gguf-split/gguf-split.cpp (split.no / split.count
u16, split.tensors.count i32; the metadata in the first part; parts named "%s-%05d-of-%05d.gguf": llama_split_path).
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import field
from typing import Sequence, Union

from .architectures import spec_from_config
from .errors import CheckpointError, UnsupportedArchitectureError
from .gguf import GGUFTensor, gguf_tensors
from .gguf_file import GGUFArray, GGUFHeader, ReadAt, parse_gguf_header
from .record import record
from .textfiles import require_regular_file

# ------------------------------------------------------------------ what is supported
# general.architecture -> the transformers model_type its config rebuilds as (planner/gguf.py GGUF_ARCHITECTURES
# read backwards). "llama" holds Llama and Mistral (convert writes both as llama; mistral's sliding window is not
# written, and llama.cpp's llama graph attends to the whole context) and, with experts, Mixtral; "deepseek2" holds
# DeepSeek-V2 and V3 (V3's router has a score-correction bias: exp_probs_b).
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "deepseek2": "deepseek_v3",
                    "gpt-oss": "gpt_oss"}
# The file type whose tensor names and shapes the cross-check compares (types are the file's own; F16 has no
# importance-matrix rules to trip on).
CHECK_FILE_TYPE = "F16"
# How many names a mismatch message lists.
NAMES_SHOWN = 3

# gguf-split's keys (gguf-py constants.py Keys.Split) and file names (llama.cpp llama_split_path).
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# A part given as a local path, or as (read(offset, n), size, name) for bytes read elsewhere (a hub range reader).
# A plan's location for a GGUF file on the hub: Ollama's name for it, hf.co/org/repo:TYPE (llama.cpp's -hf drops the
# host).
HUB_GGUF_PREFIX = "hf.co/"
GGUFSource = Union[str, "os.PathLike[str]", tuple[ReadAt, int, str]]


@record(kw_only=True)
class GGUFModel:
    """A GGUF model: its rebuilt config and its tensors as stored (all parts of a split file together)."""

    path_name: str  # the file's name as given (for messages)
    architecture: str  # general.architecture ("llama", "qwen3moe", "deepseek2", "gpt-oss", ...)
    config: dict = field(hash=False)  # an HF-style config.json dict; spec_from_config(config) gives the file's shapes
    file_type: str | None  # general.file_type by planner/gguf.py's names (GGUF_FILE_TYPES); None: absent or unknown
    tensors: tuple[GGUFTensor, ...]  # every tensor of every part, in file order: name, type, ne, exact bytes
    file_bytes: int  # the parts' sizes summed
    splits: int  # how many files
    notes: tuple[str, ...] = ()

    @property
    def tensor_bytes(self) -> int:
        """ggml_nbytes of every tensor (exact, without alignment padding)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


# ------------------------------------------------------------------ reading the parts
def open_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """A local file's header; OSError as the system raises it. A path that is no regular file (a FIFO would block, a
    device never end) is refused before it is opened and, opened without blocking, again by fstat."""
    require_regular_file(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        require_regular_file(path, st.st_mode)

        def read(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        return parse_gguf_header(read, st.st_size, str(path))


def _read_local(path: str | os.PathLike[str]) -> GGUFHeader:
    try:
        return open_gguf_header(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:  # NotRegularFileError's strerror says what it is: "is a FIFO, not a regular file"
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None


def _header(source: GGUFSource) -> GGUFHeader:
    if isinstance(source, tuple):
        read, size, name = source
        return parse_gguf_header(read, size, name)
    return _read_local(source)


def gguf_split_paths(first: str) -> list[str]:
    """Every part of the GGUF file `first` names: "x-00002-of-00003.gguf" (any part) -> x-00001 .. x-00003; a name
    without the pattern is one file. A missing part, or a part that is no regular file, is a one-line
    CheckpointError naming it."""
    m = SPLIT_NAME.match(os.fspath(first))
    if m is None:
        return [os.fspath(first)]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise CheckpointError(f"{first}: part {int(m['no'])} of {count} is no split file name llama.cpp writes")
    paths = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    for p in paths:
        try:
            require_regular_file(p)
        except FileNotFoundError:
            raise CheckpointError(f"{first} is part of a {count}-part GGUF file, but part {p} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{first} is part of a {count}-part GGUF file, but part {p} "
                                  f"{e.strerror or 'cannot be read'}") from None
    return paths


def _split_int(h: GGUFHeader, key: str, default: int) -> int:
    value = h.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{h.where}: {key} is {value!r}, not a count")
    return value


def _check_splits(headers: list[GGUFHeader], where: str) -> None:
    """The parts are one file's, in order: split.count parts, split.no 0, 1, ... and split.tensors.count tensors."""
    first = headers[0]
    count = _split_int(first, SPLIT_COUNT, 1)
    if count != len(headers):
        raise CheckpointError(f"{where}: {first.where} says the model is split into {count} files (split.count), but "
                              f"{len(headers)} were given" + ("; name the first part, x-00001-of-0000N.gguf, and the "
                                                              "others are found beside it" if count > 1 else ""))
    for i, h in enumerate(headers):
        if _split_int(h, SPLIT_NO, 0) != i:
            raise CheckpointError(f"{where}: {h.where} is split part {_split_int(h, SPLIT_NO, 0) + 1}, expected "
                                  f"part {i + 1} of {count}")
    total = sum(len(h.tensors) for h in headers)
    claimed = _split_int(first, SPLIT_TENSORS, total)
    if claimed != total:
        raise CheckpointError(f"{where}: its parts hold {total} tensors, but split.tensors.count says {claimed}")


def read_gguf_model(sources: Sequence[GGUFSource], where: str) -> GGUFModel:
    """The model the GGUF file (its parts in order) holds; CheckpointError or UnsupportedArchitectureError (one line,
    naming `where`) for a file llama.cpp would refuse, a part missing or out of order, metadata that lacks a shape,
    an architecture without a rebuild here, or tensors unlike those the rebuilt config implies."""
    if not sources:
        raise CheckpointError(f"{where}: no GGUF file given")
    headers = [_header(s) for s in sources]
    _check_splits(headers, where)
    first = headers[0]
    infos = [t for h in headers for t in h.tensors]
    if not infos:
        raise CheckpointError(f"{where} holds no tensors (a vocabulary-only GGUF?): no model to plan")
    seen: set[str] = set()
    for t in infos:
        if t.name in seen:
            raise CheckpointError(f"{where}: tensor {t.name!r} appears in two parts")
        seen.add(t.name)
    arch = first.architecture
    if arch is None:
        raise CheckpointError(f"{where}: its GGUF header has no general.architecture: cannot tell which model it holds")
    shapes = {t.name: _ne(t.shape) for t in infos}
    config, used = rebuild_config(arch, first.metadata, shapes, where)
    spec = spec_from_config(config, name=_path_name(where), source=f"GGUF metadata of {where}", where=where)
    hf_names = _cross_check(spec, shapes, where)
    tensors = tuple(GGUFTensor(name=t.name, hf_name=hf_names.get(t.name), ggml_type=t.ggml_type, shape=t.shape,
                               nbytes=t.nbytes, layer=t.layer) for t in infos)
    notes = [f"config rebuilt from GGUF metadata ({', '.join(used)}) and the tensors' shapes; checked tensor by "
             f"tensor against the {spec.model_type} inventory"]
    if len(headers) > 1:
        notes.append(f"GGUF split into {len(headers)} files")
    if first.file_type_id is not None and first.file_type is None:
        notes.append(f"general.file_type {first.file_type_id} is no llama-quantize file type vramplan names: each "
                     "tensor's own type counts")
    return GGUFModel(path_name=_path_name(where), architecture=arch, config=config, file_type=first.file_type,
                     tensors=tensors, file_bytes=sum(h.file_bytes for h in headers), splits=len(headers),
                     notes=tuple(notes + _config_notes(config, first.metadata, shapes)))


def load_gguf_model(path: str | os.PathLike[str]) -> GGUFModel:
    """A local GGUF file, every part of it when split."""
    return read_gguf_model(gguf_split_paths(os.fspath(path)), os.fspath(path))


def layer_bytes(m: GGUFModel) -> dict[int | None, int]:
    """Stored bytes per decoder layer (the blk.N.* tensors), and under None the rest (token_embd, output,
    output_norm, rope factors)."""
    out: dict[int | None, int] = {None: 0}
    for i in range(int(m.config["num_hidden_layers"])):
        out[i] = 0
    for t in m.tensors:
        out[t.layer] = out.get(t.layer, 0) + t.nbytes
    return out


def _path_name(where: str) -> str:
    return os.path.basename(where.rstrip("/")) or where


def _ne(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A ggml shape without trailing 1s (ggml_n_dims: gguf.cpp writes n_dims so, gguf-py keeps them)."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return tuple(shape[:n])


# ------------------------------------------------------------------ metadata -> config
class _Meta:
    """The `{arch}.*` keys of a header, each read checked; `used` records the keys read, for the note."""

    def __init__(self, arch: str, metadata: dict, where: str) -> None:
        self.arch, self.metadata, self.where = arch, metadata, where
        self.used: list[str] = []

    def value(self, suffix: str):
        key = f"{self.arch}.{suffix}"
        v = self.metadata.get(key)
        if v is not None:
            self.used.append(f"{key}={_shown(v)}")
        return v

    def int(self, suffix: str, default: int | None = None) -> int | None:
        """An integer key; a per-layer array must hold one value (layers unlike each other are not modelled)."""
        v = self.value(suffix)
        if isinstance(v, GGUFArray):
            values = set(v.head)
            if len(values) != 1 or not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
                raise UnsupportedArchitectureError(f"{self.where}: {self.arch}.{suffix} differs between layers "
                                                   f"({_shown(v)}): layers unlike each other are not modelled")
            v = next(iter(values))
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"{self.where}: {self.arch}.{suffix} is {_shown(v)}, not a count")
        return v

    def need(self, suffix: str) -> int:
        v = self.int(suffix)
        if v is None:
            raise CheckpointError(f"{self.where}: its GGUF header lacks {self.arch}.{suffix}, needed to rebuild the "
                                  "model's config")
        return v

    def float(self, suffix: str) -> float | None:
        v = self.value(suffix)
        return _decimal(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _decimal(v: float) -> float:
    """A float32 key's value as the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06):
    what config.json held before convert stored it in 32 bits. A value no float32 holds exactly is kept."""
    try:
        f32 = _F32.pack(v)
    except OverflowError:
        return v
    if _F32.unpack(f32)[0] != v:
        return v
    return next(c for c in (float(f"{v:.{p}g}") for p in range(1, 10)) if _F32.pack(c) == f32)


_F32 = struct.Struct("<f")


def _shown(v) -> str:
    if isinstance(v, GGUFArray):
        return f"[{', '.join(map(str, v.head[:4]))}{', ...' if v.length > 4 else ''}] ({v.length} items)"
    return repr(v) if isinstance(v, str) else str(v)


def rebuild_config(arch: str, metadata: dict, shapes: dict[str, tuple[int, ...]], where: str) -> tuple[dict, list]:
    """The HF-style config.json dict of the model a GGUF header describes, and the `{arch}.*` keys it was read from.
    `shapes`: every tensor's ggml shape (ne) by name."""
    model_type = GGUF_MODEL_TYPES.get(arch)
    if model_type is None:
        raise UnsupportedArchitectureError(f"{where}: GGUF architecture {arch!r} is not one vramplan rebuilds a config "
                                           f"for; supported: {', '.join(GGUF_MODEL_TYPES)}")
    meta = _Meta(arch, metadata, where)
    embd = shapes.get("token_embd.weight")
    if embd is None or len(embd) != 2:
        raise CheckpointError(f"{where}: no 2-D token_embd.weight: not a {arch} model llama.cpp loads")
    hidden = meta.need("embedding_length")
    if embd[0] != hidden:
        raise CheckpointError(f"{where}: token_embd.weight rows are {embd[0]} wide but {arch}.embedding_length is "
                              f"{hidden}")
    cfg: dict = {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": meta.need("block_count"),
                 "num_attention_heads": meta.need("attention.head_count"), "vocab_size": embd[1],
                 "tie_word_embeddings": "output.weight" not in shapes}
    cfg["num_key_value_heads"] = meta.int("attention.head_count_kv", cfg["num_attention_heads"])
    _optional(cfg, "intermediate_size", meta.int("feed_forward_length"))
    _optional(cfg, "max_position_embeddings", meta.int("context_length"))
    _optional(cfg, "rope_theta", meta.float("rope.freq_base"))
    _optional(cfg, "rms_norm_eps", meta.float("attention.layer_norm_rms_epsilon"))
    dtype = _float_dtype(metadata)
    if dtype:
        cfg["torch_dtype"] = dtype
    if arch == "deepseek2":
        _mla(cfg, meta, shapes)
    else:
        _mha(cfg, meta, shapes, arch)
    if meta.int("expert_count", 0):
        _moe(cfg, meta, shapes, arch)
    elif arch in ("qwen3moe", "gpt-oss"):
        raise CheckpointError(f"{where}: a {arch} file without {arch}.expert_count")
    _rope_scaling(cfg, meta, shapes, arch)
    return cfg, meta.used


def _optional(cfg: dict, key: str, value) -> None:
    if value is not None:
        cfg[key] = value


def _has(shapes: dict, suffix: str) -> bool:
    """Whether some decoder layer holds blk.N.<suffix>."""
    return any(n.startswith("blk.") and n.split(".", 2)[2] == suffix for n in shapes)


def _float_dtype(metadata: dict) -> str | None:
    """The load dtype of an unquantized file (general.file_type F32 / F16 / BF16); None for a quantized one, whose
    original dtype the file does not say."""
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(metadata.get("general.file_type"))


def _mha(cfg: dict, meta: _Meta, shapes: dict, arch: str) -> None:
    """Grouped-query attention: head_dim (key_length, else hidden / heads), biases and q/k norms as the tensors show,
    the sliding window."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    key, value = meta.int("attention.key_length"), meta.int("attention.value_length")
    if key is not None and value is not None and key != value:
        raise UnsupportedArchitectureError(f"{meta.where}: keys of {key} and values of {value} per head: not a "
                                           f"{arch} model vramplan models")
    cfg["head_dim"] = key or value or hidden // heads
    bias = _has(shapes, "attn_q.bias")
    if arch == "qwen2":
        if not bias:
            raise CheckpointError(f"{meta.where}: a qwen2 file without q/k/v biases (blk.N.attn_q.bias)")
    elif arch != "phi3":
        cfg["attention_bias"] = bias
    if arch == "llama":
        cfg["mlp_bias"] = _has(shapes, "ffn_up.bias")
    if arch == "phi3":
        rope_dims = meta.int("rope.dimension_count")
        if rope_dims and rope_dims != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = rope_dims * heads / hidden
    window = meta.int("attention.sliding_window", 0)
    if window and arch in ("gemma2", "gemma3", "phi3", "gpt-oss"):
        cfg["sliding_window"] = window
    if arch == "gemma3":
        pattern = meta.value("attention.sliding_window_pattern")
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            cfg["sliding_window_pattern"] = pattern
        elif isinstance(pattern, GGUFArray) and pattern.complete and pattern.length == cfg["num_hidden_layers"]:
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern.head]


def _mla(cfg: dict, meta: _Meta, shapes: dict) -> None:
    """DeepSeek-V2/V3 multi-head latent attention. Files since llama.cpp wrote MLA as MQA hold key_length_mla /
    value_length_mla (the per-head sizes); older ones hold them in key_length / value_length."""
    rope = meta.need("rope.dimension_count")
    mla_key, mla_value = meta.int("attention.key_length_mla"), meta.int("attention.value_length_mla")
    key = mla_key if mla_key is not None else meta.need("attention.key_length")
    value = mla_value if mla_value is not None else meta.need("attention.value_length")
    if key <= rope:
        raise CheckpointError(f"{meta.where}: keys of {key} per head leave nothing beside the {rope} RoPE dimensions")
    cfg.update(num_key_value_heads=cfg["num_attention_heads"], kv_lora_rank=meta.need("attention.kv_lora_rank"),
               qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value,
               attention_bias=_has(shapes, "attn_kv_a_mqa.bias"))
    q_lora = meta.int("attention.q_lora_rank", 0)
    cfg["q_lora_rank"] = q_lora or None  # 0 or absent: a plain q_proj (DeepSeek-V2-Lite)
    cfg["first_k_dense_replace"] = meta.int("leading_dense_block_count", 0)
    if not any(".exp_probs_b." in n for n in shapes):
        cfg["model_type"] = "deepseek_v2"  # no router score-correction bias: V2's greedy / group-limited routing


def _moe(cfg: dict, meta: _Meta, shapes: dict, arch: str) -> None:
    """Routed experts: count, top-k, width (expert_feed_forward_length, else the expert tensors' rows), shared
    experts, and which layers are dense (no router: Qwen3-MoE's mlp_only_layers)."""
    experts, used = meta.need("expert_count"), meta.need("expert_used_count")
    gate = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_exps.weight")), None)
    width = meta.int("expert_feed_forward_length") or (gate[1] if gate and len(gate) == 3 else None)
    if width is None:
        raise CheckpointError(f"{meta.where}: its GGUF header lacks {arch}.expert_feed_forward_length and it has no "
                              "ffn_gate_exps tensor to read the experts' width from")
    if arch == "llama":  # Mixtral: intermediate_size is the experts' width
        cfg.update(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=used, intermediate_size=width)
    elif arch == "gpt-oss":
        cfg.update(num_local_experts=experts, num_experts_per_tok=used, intermediate_size=width)
    elif arch == "qwen3moe":
        cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=width)
        cfg.setdefault("intermediate_size", width)
        dense = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
        if dense:
            cfg["mlp_only_layers"] = dense
    elif arch == "deepseek2":
        cfg.update(n_routed_experts=experts, num_experts_per_tok=used, moe_intermediate_size=width)
        shared = meta.int("expert_shared_count")
        if shared is None:
            shexp = next((s for n, s in shapes.items() if n.endswith(".ffn_gate_shexp.weight")), None)
            shared = shexp[1] // width if shexp else 0
        cfg["n_shared_experts"] = shared
        cfg.setdefault("intermediate_size", width)
    else:
        raise UnsupportedArchitectureError(f"{meta.where}: a {arch} file with experts ({arch}.expert_count "
                                           f"{experts}) is no model vramplan rebuilds")


def _rope_scaling(cfg: dict, meta: _Meta, shapes: dict, arch: str) -> None:
    """RoPE scaling as far as it shapes tensors or the context: llama3's rope_freqs and phi3's rope factors are
    tensors (their values stay in the file), YaRN / linear scaling their keys."""
    kind = meta.value("rope.scaling.type")
    factor = meta.float("rope.scaling.factor")
    original = meta.int("rope.scaling.original_context_length")
    rope: dict = {}
    if isinstance(kind, str) and kind not in ("none", ""):
        rope["rope_type"] = kind
    if arch == "llama" and "rope_freqs.weight" in shapes:
        rope["rope_type"] = "llama3"
    long = shapes.get("rope_factors_long.weight")
    if arch == "phi3" and long is not None:
        # placeholders of the file's length: the factors themselves are tensor data, which the planner does not read
        rope.update(rope_type="longrope", long_factor=[1.0] * long[0], short_factor=[1.0] * long[0])
    if not rope:
        return
    if factor is not None and factor >= 1:
        rope["factor"] = factor
    if original:
        rope["original_max_position_embeddings"] = original
    cfg["rope_scaling"] = rope


def _config_notes(cfg: dict, metadata: dict, shapes: dict) -> list[str]:
    notes = []
    if cfg["tie_word_embeddings"]:
        notes.append("tied embeddings: the file has no output.weight, token_embd serves as the output")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GGUFArray) and tokens.length != cfg["vocab_size"]:
        notes.append(f"the tokenizer holds {tokens.length} tokens, token_embd.weight {cfg['vocab_size']} rows: "
                     "vocab_size is the rows")
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type") in ("llama3", "longrope"):
        notes.append(f"{rope['rope_type']} RoPE: its factors are tensor data in the file, not metadata (the config's "
                     "rope_scaling names the type only)")
    if "torch_dtype" not in cfg:
        notes.append("the original checkpoint's dtype is not in a quantized GGUF's metadata: torch_dtype left unset")
    return notes


# ------------------------------------------------------------------ the cross-check
# Older DeepSeek GGUFs (before llama.cpp wrote MLA as MQA) keep kv_b_proj whole as attn_kv_b; planner/gguf.py names
# the split convert writes now, attn_k_b + attn_v_b. Either holds the same weights.
MERGED_FORMS = {"attn_kv_b.weight": ("attn_k_b.weight", "attn_v_b.weight")}


def _cross_check(spec, shapes: dict[str, tuple[int, ...]], where: str) -> dict[str, str | None]:
    """The file's tensors against those planner/gguf.py names for `spec`: the same names and shapes (ggml order),
    else a one-line CheckpointError. Returns each file tensor's transformers name (None: convert made it)."""
    predicted = {t.name: t for t in gguf_tensors(spec, CHECK_FILE_TYPE)}
    hf_names: dict[str, str | None] = {}
    for name, ne in shapes.items():
        t = predicted.get(name)
        if t is None:
            continue
        if _ne(t.shape) != ne:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(ne)} in the file, but the {spec.model_type} "
                                  f"config rebuilt from its metadata implies {list(_ne(t.shape))}")
        hf_names[name] = t.hf_name
    extra = [n for n in shapes if n not in predicted]
    missing = [n for n in predicted if n not in shapes]
    extra, missing = _merged_forms(extra, missing, predicted, shapes, hf_names)
    if extra or missing:
        parts = []
        if missing:
            parts.append(f"lacks {_names(missing)}")
        if extra:
            parts.append(f"holds {_names(extra)} besides")
        raise CheckpointError(f"{where}: the file {' and '.join(parts)}, unlike the {spec.model_type} model its "
                              "metadata describes (another architecture's tensors, or a converter vramplan does not "
                              "know)")
    return hf_names


def _merged_forms(extra: list[str], missing: list[str], predicted: dict, shapes: dict,
                  hf_names: dict) -> tuple[list[str], list[str]]:
    """Accept a file tensor that holds two predicted ones whole (MERGED_FORMS), element for element."""
    for name in list(extra):
        m = re.match(r"^(blk\.\d+\.)(.+)$", name)
        if m is None or m.group(2) not in MERGED_FORMS:
            continue
        parts = [m.group(1) + p for p in MERGED_FORMS[m.group(2)]]
        if not all(p in predicted for p in parts):
            continue
        if all(p in missing for p in parts):
            if math.prod(shapes[name]) != sum(math.prod(predicted[p].shape) for p in parts):
                continue
            missing = [n for n in missing if n not in parts]
        elif any(p in missing for p in parts):
            continue
        extra.remove(name)
        hf_names[name] = predicted[parts[0]].hf_name
    return extra, missing


def _names(names: list[str]) -> str:
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return ", ".join(names[:NAMES_SHOWN]) + more
