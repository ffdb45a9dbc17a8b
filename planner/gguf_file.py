"""A GGUF file's header, read and checked: its version, alignment, key/values and every tensor's type, shape, offset
and exact bytes; and whether the file is the model a ModelSpec describes.

`parse_gguf_header(read, size, where)` reads through a callback, `read(offset, n) -> bytes` (fewer bytes only at the
file's end), so one parser serves a local file (runtime/llamacpp_run.py opens it) and HTTP range reads of a hub file.
Pure: it opens nothing and writes nothing.

A header is hostile input: every length and count it claims is checked against the bytes left in the file before
anything is read, skipped or kept, arrays nest at most MAX_ARRAY_DEPTH deep, and what is kept is bounded (long arrays
keep a prefix and their length, very long strings only their length). Anything llama.cpp would refuse, and anything
cut short, is a one-line CheckpointError naming the file.

The format and its checks follow llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f (as planner/gguf.py):
ggml/include/gguf.h (the layout, enum gguf_type, GGUF_DEFAULT_ALIGNMENT), ggml/src/gguf.cpp (gguf_init_from_reader:
version, counts, keys, value types, alignment, tensor infos, offsets), ggml/include/ggml.h (GGML_MAX_DIMS,
GGML_MAX_NAME, enum ggml_type) and ggml/src/ggml.c (ggml_nbytes).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import field
from typing import Callable, NoReturn

from .errors import CheckpointError
from .gguf import (GGML_TYPES, GGUF_ALIGNMENT, GGUF_ARCHITECTURES, GGUF_FILE_TYPES, GGMLType, GGUFTensor,
                   gguf_tensors)
from .modelspec import ModelSpec
from .record import record
from .units import format_bytes

ReadAt = Callable[[int, int], bytes]  # read(offset, n) -> up to n bytes from offset

# ------------------------------------------------------------------ the format (gguf.h, gguf.cpp, ggml.h)
GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3  # the newest version llama.cpp reads; 1 is refused (32-bit lengths), 2 reads as 3
GGUF_MAX_STRING_LENGTH = 1024 * 1024 * 1024  # gguf.cpp: a longer string is refused
GGUF_MAX_ARRAY_ELEMENTS = 1024 * 1024 * 1024  # gguf.cpp: a longer array is refused
GGML_MAX_DIMS = 4  # ggml.h: a tensor has at most 4 dimensions
GGML_MAX_NAME = 64  # ggml.h: a tensor name of 64 bytes or more is refused (gguf.cpp)
INT64_MAX = 2**63 - 1  # gguf.cpp: a tensor's element count must fit an int64
# gguf.cpp reads an array's items only as scalars or strings: an array of arrays is an "invalid GGUF type" there.
MAX_ARRAY_DEPTH = 1
GGUF_TYPE_STRING = 8
GGUF_TYPE_ARRAY = 9
GGUF_TYPE_BOOL = 7
# enum gguf_type: id -> (gguf.cpp's GGUF_TYPE_NAME, little-endian struct format) for the fixed-size types
SCALAR_TYPES = {0: ("u8", "<B"), 1: ("i8", "<b"), 2: ("u16", "<H"), 3: ("i16", "<h"), 4: ("u32", "<I"),
                5: ("i32", "<i"), 6: ("f32", "<f"), GGUF_TYPE_BOOL: ("bool", "<b"), 10: ("u64", "<Q"),
                11: ("i64", "<q"), 12: ("f64", "<d")}
_SCALARS = {tid: (name, struct.Struct(fmt)) for tid, (name, fmt) in SCALAR_TYPES.items()}
_U32, _I32, _U64, _I64 = (struct.Struct(f) for f in ("<I", "<i", "<Q", "<q"))
HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version u32, n_tensors i64, n_kv i64
# The fewest bytes one key/value and one tensor info can take: what bounds the counts a header claims.
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length u64, a one-byte key, value type i32, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length u64 (an empty name), n_dims u32 (0), type i32, offset u64
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.type_id: t for t in GGML_TYPES.values()}
FILE_TYPE_NAMES = {f.ftype_id: name for name, f in GGUF_FILE_TYPES.items()}  # general.file_type -> planner name

# ------------------------------------------------------------------ what is kept (vramplan's bounds)
READ_CHUNK_BYTES = 1024 * 1024  # bytes asked of `read` at a time (one range request of a hub file)
ARRAY_HEAD_ITEMS = 1024  # an array keeps its first items (any model's per-layer arrays fit), and its length
KEPT_STRING_BYTES = 1024 * 1024  # a longer string value keeps only its length (chat templates are ~1-20 KiB)
KEPT_ITEM_BYTES = 4096  # a longer string in an array keeps only its length (tokens and merges are a few bytes)
KEPT_VALUE_BYTES = 64 * 1024 * 1024  # string bytes a header keeps in all; later strings keep only their lengths
# The GGUF specification (ggml-org/ggml docs/gguf.md): a key "must be at most 2^16-1 bytes long".
MAX_KEY_BYTES = 2**16 - 1


@record(kw_only=True)
class GGUFArray:
    """An array value: its item type (gguf.cpp's type names: "u32", "str", ...), its length and its first items."""

    item_type: str
    length: int
    head: tuple  # the first min(length, ARRAY_HEAD_ITEMS) items

    @property
    def complete(self) -> bool:
        """Whether `head` holds every item."""
        return len(self.head) == self.length


@record(kw_only=True)
class GGUFLongString:
    """A string value longer than KEPT_STRING_BYTES: only its length is kept."""

    length: int


@record(kw_only=True)
class GGUFTensorInfo:
    """One tensor of the file as its header describes it."""

    name: str
    ggml_type: str  # planner/gguf.py's GGML_TYPES name
    shape: tuple[int, ...]  # ne, ggml order: shape[0] is the row length
    offset: int  # from the start of the data section
    nbytes: int  # ggml_nbytes: exact data bytes, without the alignment padding after them

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layer(self) -> int | None:
        """The decoder layer of a `blk.N.` tensor; None for the others."""
        m = re.match(r"blk\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


@record(kw_only=True)
class GGUFHeader:
    """A GGUF file's header: what llama.cpp reads before the tensor data."""

    where: str  # the file, for messages
    version: int
    alignment: int  # general.alignment, GGUF_ALIGNMENT by default
    metadata: dict = field(hash=False)  # key -> int | float | bool | str | GGUFArray | GGUFLongString
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int  # where the data section starts in the file
    file_bytes: int

    @property
    def architecture(self) -> str | None:
        """general.architecture ("llama", "qwen2", ...)."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def file_type_id(self) -> int | None:
        """general.file_type: llama.h's llama_ftype."""
        return self.int_value("general.file_type")

    @property
    def file_type(self) -> str | None:
        """general.file_type by planner/gguf.py's names (GGUF_FILE_TYPES); None when absent or not one of them."""
        return FILE_TYPE_NAMES.get(self.file_type_id) if self.file_type_id is not None else None

    def arch_int(self, suffix: str) -> int | None:
        """`{architecture}.{suffix}` as an int (the largest of a per-layer array); None when absent."""
        return self.int_value(f"{self.architecture}.{suffix}") if self.architecture else None

    def int_value(self, key: str) -> int | None:
        """An integer key's value; of an integer array, its largest kept item; None when absent or not integer."""
        value = self.metadata.get(key)
        if isinstance(value, GGUFArray):
            ints = [v for v in value.head if isinstance(v, int) and not isinstance(v, bool)]
            return max(ints) if ints else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def block_count(self) -> int | None:
        return self.arch_int("block_count")

    @property
    def embedding_length(self) -> int | None:
        return self.arch_int("embedding_length")

    @property
    def feed_forward_length(self) -> int | None:
        return self.arch_int("feed_forward_length")

    @property
    def head_count(self) -> int | None:
        return self.arch_int("attention.head_count")

    @property
    def head_count_kv(self) -> int | None:
        return self.arch_int("attention.head_count_kv")

    @property
    def context_length(self) -> int | None:
        return self.arch_int("context_length")

    @property
    def expert_count(self) -> int | None:
        return self.arch_int("expert_count")

    @property
    def expert_used_count(self) -> int | None:
        return self.arch_int("expert_used_count")

    @property
    def tensor_bytes(self) -> int:
        """Data bytes of every tensor (ggml_nbytes), without padding."""
        return sum(t.nbytes for t in self.tensors)


# ------------------------------------------------------------------ reading
class _Cursor:
    """The header read front to back through `read`, a chunk at a time. Every read or skip is checked against the
    bytes left in the file first, so no claimed length is ever allocated or waited for."""

    def __init__(self, read: ReadAt, size: int, where: str) -> None:
        self._read, self.size, self.where = read, size, where
        self.pos = 0
        self._buf, self._buf_start = b"", 0
        self.kept_budget = KEPT_VALUE_BYTES  # string bytes values may still keep

    def fail(self, what: str) -> NoReturn:
        raise CheckpointError(f"{self.where}: {what}")

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        """`n` more bytes must be in the file."""
        if n > self.left:
            self.fail(f"{what} needs {n:,} bytes at byte {self.pos:,} but the file ends {self.left:,} bytes later "
                      "(a truncated or corrupt GGUF header)")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        at = self.pos - self._buf_start
        if at < 0 or at + n > len(self._buf):
            self._fill(n, what)
            at = 0
        self.pos += n
        return self._buf[at:at + n]

    def _fill(self, n: int, what: str) -> None:
        want = min(max(n, READ_CHUNK_BYTES), self.left)
        data = bytes(self._read(self.pos, want))
        if len(data) < n:
            self.fail(f"{what}: the file ended at byte {self.pos + len(data):,}, before the {self.size:,} bytes "
                      "its size promised")
        self._buf, self._buf_start = data, self.pos

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def unpack(self, s: struct.Struct, what: str):
        return s.unpack(self.take(s.size, what))[0]

    def skip_strings(self, count: int, what: str) -> None:
        """Past `count` GGUF strings, each length checked before it is skipped. A tokenizer has some 150k tokens and
        as many merges: this loop reads the lengths straight from the buffer."""
        unpack, size = _U64.unpack_from, self.size
        buf, start, pos = self._buf, self._buf_start, self.pos
        last = start + len(buf) - 8  # the last position whose length is in the buffer
        for _ in range(count):
            if not start <= pos <= last:
                self.pos = pos
                self.need(8, f"{what} (string length)")
                self._fill(8, what)
                buf, start = self._buf, self._buf_start
                last = start + len(buf) - 8
            n = unpack(buf, pos - start)[0]
            pos += 8 + n
            if pos > size or n > GGUF_MAX_STRING_LENGTH:
                self._string_fail(n, pos - 8 - n, what)
        self.pos = pos

    def _string_fail(self, n: int, at: int, what: str) -> NoReturn:
        """A string length at byte `at` that is too long for llama.cpp or runs past the file's end."""
        if n > GGUF_MAX_STRING_LENGTH:
            self.fail(f"{what} claims a {n:,}-byte string at byte {at:,}, more than llama.cpp reads "
                      f"({GGUF_MAX_STRING_LENGTH:,}: GGUF_MAX_STRING_LENGTH)")
        self.fail(f"{what} claims a {n:,}-byte string at byte {at:,}, past the file's end ({self.size:,} bytes: a "
                  "truncated or corrupt GGUF header)")


def _string(cur: _Cursor, what: str, *, keep: int) -> str | GGUFLongString:
    """A GGUF string (u64 length, bytes): decoded when at most `keep` bytes, else skipped and kept as its length."""
    n = cur.unpack(_U64, f"{what} (string length)")
    if n > GGUF_MAX_STRING_LENGTH:
        cur.fail(f"{what} claims {n:,} bytes, more than llama.cpp reads in a string "
                 f"({GGUF_MAX_STRING_LENGTH:,}: GGUF_MAX_STRING_LENGTH)")
    if n > keep:
        cur.skip(n, what)
        return GGUFLongString(length=n)
    return cur.take(n, what).decode("utf-8", errors="replace")


def _kept_string(cur: _Cursor, what: str, keep: int) -> str | GGUFLongString:
    """A string value, kept while the header's KEPT_VALUE_BYTES last."""
    value = _string(cur, what, keep=min(keep, cur.kept_budget))
    if isinstance(value, str):
        cur.kept_budget -= len(value.encode())
    return value


def _name(cur: _Cursor, what: str, limit: int, rule: str) -> str:
    """A key or tensor name, refused (unread) when longer than `limit` bytes (`rule` says whose limit)."""
    name = _string(cur, what, keep=limit)
    if isinstance(name, GGUFLongString):
        cur.fail(f"{what} is {name.length:,} bytes long, more than {limit:,} ({rule})")
    return name


def _value_type(cur: _Cursor, what: str) -> int:
    type_id = cur.unpack(_I32, f"{what} (value type)")
    if type_id not in _SCALARS and type_id not in (GGUF_TYPE_STRING, GGUF_TYPE_ARRAY):
        cur.fail(f"{what} has an unknown value type {type_id} (gguf.h enum gguf_type: 0-12)")
    return type_id


def _value(cur: _Cursor, type_id: int, what: str, depth: int):
    """One value of a known type: a number, a bool, a string (GGUFLongString when long), or a GGUFArray. `depth`: how
    many arrays it is inside."""
    if type_id == GGUF_TYPE_STRING:
        return _kept_string(cur, what, KEPT_ITEM_BYTES if depth else KEPT_STRING_BYTES)
    if type_id == GGUF_TYPE_ARRAY:
        return _array(cur, what, depth + 1)
    s = _SCALARS[type_id][1]
    v = cur.unpack(s, what)
    return v != 0 if type_id == GGUF_TYPE_BOOL else v


def _array(cur: _Cursor, what: str, depth: int) -> GGUFArray:
    """An array `depth` deep (1: a key's value): item type i32, length u64, the items; its length bounded by the
    bytes left before any item is read."""
    item_type = _value_type(cur, f"{what} (array items)")
    if item_type == GGUF_TYPE_ARRAY and depth >= MAX_ARRAY_DEPTH:
        cur.fail(f"{what} nests arrays {depth + 1} deep; llama.cpp reads {MAX_ARRAY_DEPTH} at most (MAX_ARRAY_DEPTH)")
    n = cur.unpack(_U64, f"{what} (array length)")
    if n > GGUF_MAX_ARRAY_ELEMENTS:
        cur.fail(f"{what} claims {n:,} items, more than llama.cpp reads in an array "
                 f"({GGUF_MAX_ARRAY_ELEMENTS:,}: GGUF_MAX_ARRAY_ELEMENTS)")
    smallest = _SCALARS[item_type][1].size if item_type in _SCALARS else 8 if item_type == GGUF_TYPE_STRING else 12
    cur.need(n * smallest, f"{what} ({n:,} array items)")
    kept = min(n, ARRAY_HEAD_ITEMS)
    name = _SCALARS[item_type][0] if item_type in _SCALARS else "str" if item_type == GGUF_TYPE_STRING else "arr"
    head = tuple(_value(cur, item_type, what, depth) for _ in range(kept))
    if item_type in _SCALARS:
        cur.skip((n - kept) * smallest, what)
    elif item_type == GGUF_TYPE_STRING:
        cur.skip_strings(n - kept, what)
    else:
        for _ in range(n - kept):
            _value(cur, item_type, what, depth)
    return GGUFArray(item_type=name, length=n, head=head)


def _header_counts(cur: _Cursor) -> tuple[int, int, int]:
    """Magic, version and the two counts, each checked as gguf.cpp does, the counts also against the file's size."""
    if cur.left < len(GGUF_MAGIC) or cur.take(len(GGUF_MAGIC), "the GGUF magic") != GGUF_MAGIC:
        raise CheckpointError(f"{cur.where} is not a GGUF file (no GGUF magic)")
    version = cur.unpack(_U32, "the GGUF version")
    if version & 0xFFFF == 0:
        cur.fail(f"GGUF version {version:#x}: a file of the other byte order (llama.cpp reads little-endian files)")
    if version < 2 or version > GGUF_VERSION:
        cur.fail(f"GGUF version {version}: llama.cpp reads versions 2 and {GGUF_VERSION}")
    n_tensors = cur.unpack(_I64, "the tensor count")
    n_kv = cur.unpack(_I64, "the key/value count")
    if n_tensors < 0 or n_kv < 0:
        cur.fail(f"negative counts: {n_tensors:,} tensors, {n_kv:,} key/values")
    if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > cur.left:
        cur.fail(f"{n_kv:,} key/values and {n_tensors:,} tensors cannot fit the {cur.left:,} bytes left in the file")
    return version, n_tensors, n_kv


def _metadata(cur: _Cursor, n_kv: int) -> dict:
    metadata: dict = {}
    for i in range(n_kv):
        key = _name(cur, f"key {i}", MAX_KEY_BYTES, "the GGUF specification's longest key")
        if not key:
            cur.fail(f"key {i} is empty")
        if key in metadata:
            cur.fail(f"key {key!r} appears twice")
        metadata[key] = _value(cur, _value_type(cur, f"key {key!r}"), f"key {key!r}", 0)
    return metadata


def _alignment(cur: _Cursor, metadata: dict) -> int:
    """general.alignment: a u32 power of two (gguf.cpp), GGUF_ALIGNMENT when absent."""
    value = metadata.get("general.alignment", GGUF_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        cur.fail(f"general.alignment {value!r} is not a power of two")
    return value


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
    """One tensor info: name, n_dims u32, ne i64 each, ggml type i32, offset u64; checked as gguf.cpp does."""
    name = _name(cur, f"tensor {i} (name)", GGML_MAX_NAME - 1, "ggml.h GGML_MAX_NAME")
    n_dims = cur.unpack(_U32, f"tensor {name!r} (dimension count)")
    if n_dims > GGML_MAX_DIMS:
        cur.fail(f"tensor {name!r} has {n_dims:,} dimensions; ggml has at most {GGML_MAX_DIMS}")
    shape = tuple(cur.unpack(_I64, f"tensor {name!r} (shape)") for _ in range(n_dims)) or (1,)
    if any(d < 0 for d in shape) or math.prod(shape) > INT64_MAX:
        cur.fail(f"tensor {name!r} has an impossible shape {list(shape)}")
    type_id = cur.unpack(_I32, f"tensor {name!r} (type)")
    ggml_type = GGML_TYPES_BY_ID.get(type_id)
    if ggml_type is None:
        cur.fail(f"tensor {name!r} has an unknown ggml type {type_id} (ggml.h enum ggml_type)")
    if shape[0] % ggml_type.block_elements:
        cur.fail(f"tensor {name!r} ({ggml_type.name}) has rows of {shape[0]:,}, not whole "
                 f"{ggml_type.block_elements}-element blocks")
    offset = cur.unpack(_U64, f"tensor {name!r} (offset)")
    return name, shape, ggml_type, offset


def _nbytes(shape: tuple[int, ...], t: GGMLType) -> int:
    """ggml_nbytes: 0 for a tensor with an empty dimension."""
    return 0 if 0 in shape else math.prod(shape[1:]) * t.row_bytes(shape[0])


def _tensors(cur: _Cursor, n_tensors: int, alignment: int) -> tuple[tuple[GGUFTensorInfo, ...], int]:
    """Every tensor info, then the data section's start; each tensor's data must follow the previous one's, padded
    to the alignment (gguf.cpp), and end inside the file."""
    infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name, shape, ggml_type, offset = _tensor_info(cur, i)
        if name in seen:
            cur.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        infos.append(GGUFTensorInfo(name=name, ggml_type=ggml_type.name, shape=shape, offset=offset,
                                    nbytes=_nbytes(shape, ggml_type)))
    data_start = -(-cur.pos // alignment) * alignment if n_tensors else cur.pos
    expected = 0
    for t in infos:
        if t.offset != expected:
            cur.fail(f"tensor {t.name!r} has data offset {t.offset:,}; llama.cpp expects {expected:,} (each "
                     f"tensor's data follows the previous one's, padded to {alignment})")
        end = data_start + t.offset + t.nbytes
        if end > cur.size:
            cur.fail(f"tensor {t.name!r} ({t.ggml_type} {list(t.shape)}, {t.nbytes:,} bytes) runs past the end of "
                     f"the file: its data would end at byte {end:,} of {cur.size:,} (a truncated file)")
        expected += -(-t.nbytes // alignment) * alignment
    return tuple(infos), data_start


def parse_gguf_header(read: ReadAt, size: int, where: str) -> GGUFHeader:
    """The header of the `size`-byte GGUF file that `read(offset, n)` reads; CheckpointError (one line, naming
    `where`) for anything llama.cpp would refuse or a file cut short."""
    cur = _Cursor(read, size, where)
    version, n_tensors, n_kv = _header_counts(cur)
    metadata = _metadata(cur, n_kv)
    alignment = _alignment(cur, metadata)
    tensors, data_start = _tensors(cur, n_tensors, alignment)
    return GGUFHeader(where=where, version=version, alignment=alignment, metadata=metadata, tensors=tensors,
                      data_start=data_start, file_bytes=size)


def as_gguf_tensors(h: GGUFHeader) -> tuple[GGUFTensor, ...]:
    """The file's tensors as planner/gguf.py's records (what gguf_tensors predicts), in the file's order: what a
    llama.cpp plan of this very file would count in place of the prediction."""
    return tuple(GGUFTensor(name=t.name, hf_name=None, ggml_type=t.ggml_type, shape=t.shape, nbytes=t.nbytes,
                            layer=t.layer) for t in h.tensors)


# ------------------------------------------------------------------ is it the model's file?
# How far the file's tensor bytes may be from planner/gguf.py's for its file type before the file is refused as
# another model's: imatrix choices, vocabulary trims and mixtures re-tuned by their publisher move a few percent;
# another model's file differs by far more (a 60 GiB file is no 0.5B model's).
TENSOR_BYTES_TOLERANCE = 0.10


def _file_model(h: GGUFHeader) -> str:
    return f"a {h.architecture!r} model with {h.block_count} layers of width {h.embedding_length}"


def _spec_model(spec: ModelSpec) -> str:
    arch = GGUF_ARCHITECTURES.get(spec.model_type, spec.model_type)
    return f"a {arch!r} model with {spec.num_layers} layers of width {spec.hidden_size}"


def comparable_tensor_bytes(h: GGUFHeader, spec: ModelSpec, file_type: str) -> tuple[int, int]:
    """(the file's tensor bytes, planner/gguf.py's for `spec` at `file_type`), like for like: a separate
    output.weight in the file of a model whose spec ties it (Qwen's own Qwen2.5-0.5B GGUFs) is left out."""
    predicted = gguf_tensors(spec, file_type)
    tied = not any(t.name == "output.weight" for t in predicted)
    actual = sum(t.nbytes for t in h.tensors if not (tied and t.name == "output.weight"))
    return actual, sum(t.nbytes for t in predicted)


def check_gguf_matches(h: GGUFHeader, spec: ModelSpec) -> None:
    """CheckpointError unless the file is `spec`'s model: its architecture, layer count and width, then (for a file
    type planner/gguf.py sizes) its tensor bytes within TENSOR_BYTES_TOLERANCE of planner/gguf.py's."""
    expected_arch = GGUF_ARCHITECTURES.get(spec.model_type)
    if not h.tensors:
        raise CheckpointError(f"{h.where} holds no tensors (a vocabulary-only GGUF?): no model to run")
    if h.architecture is None or h.block_count is None or h.embedding_length is None:
        raise CheckpointError(f"{h.where}: its header lacks general.architecture, or its block_count or "
                              "embedding_length: cannot tell which model it holds")
    if (expected_arch not in (None, h.architecture) or h.block_count != spec.num_layers
            or h.embedding_length != spec.hidden_size):
        raise CheckpointError(f"{h.where} is {_file_model(h)}; --model {spec.name} is {_spec_model(spec)}: not the "
                              "model the file was converted from")
    if h.file_type is None:
        return
    actual, predicted = comparable_tensor_bytes(h, spec, h.file_type)
    if predicted and abs(actual - predicted) > TENSOR_BYTES_TOLERANCE * predicted:
        raise CheckpointError(f"{h.where} holds {format_bytes(actual)} of tensors; --model {spec.name} as "
                              f"{h.file_type} holds {format_bytes(predicted)} ({actual / predicted - 1:+.0%}, beyond "
                              f"the {TENSOR_BYTES_TOLERANCE:.0%} tolerance): not this model's file")
