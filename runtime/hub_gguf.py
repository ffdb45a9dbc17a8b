"""A GGUF file on the Hugging Face hub, named as llama.cpp's `-hf` and Ollama's `hf.co/` name it: `org/repo:Q4_K_M`.

The repository's file list says which file (or split parts) holds that type; each part's header is read by HTTP range
reads in blocks of GGUF_READ_BLOCK bytes (the header and its tokenizer, never the tensors' data) and parsed by
planner/gguf_file.py's bounded parser; planner/gguf_model.py rebuilds the model from it, exactly as for a local file.
No torch; huggingface_hub as in runtime/hub.py (its endpoint, token, timeouts and deadline)."""

from __future__ import annotations

import re

from vramplan.planner.errors import CheckpointError
from vramplan.planner.gguf_model import HUB_GGUF_PREFIX, GGUFModel, read_gguf_model  # noqa: F401 - cli_inputs'

# org/repo:TAG, where TAG names a quant type as the file names spell it (Q4_K_M, IQ2_XXS, q8_0, UD-IQ1_S, BF16, ...).
HUB_GGUF_RE = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<tag>[A-Za-z0-9][\w.-]*)")
GGUF_READ_BLOCK = 4 * 1024 * 1024  # a header with a 150k-token vocabulary is a few MiB: one or two reads
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)


def is_hub_gguf(name: str) -> bool:
    return HUB_GGUF_RE.fullmatch(name) is not None and not name.startswith((".", "/", "~"))


def choose_files(repo: str, tag: str, files: list[str]) -> list[str]:
    """The file (or every split part, in order) of `files` whose name carries `tag` as a whole word, case-insensitive;
    a one-line CheckpointError naming the types there are when none or several files do (mmproj files never count)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if not ggufs:
        raise CheckpointError(f"{repo} has no GGUF files")
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9])", re.I)
    hits = [f for f in ggufs if word.search(f.rsplit("/", 1)[-1].removesuffix(".gguf"))
            or word.search(f.rsplit("/", 1)[0] if "/" in f else "")]
    groups: dict[str, list[str]] = {}
    for f in hits:
        groups.setdefault(SPLIT_PART.sub("", f), []).append(f)
    if len(groups) != 1:
        names = sorted(ggufs, key=len)[:6]
        what = "no file" if not groups else f"{len(groups)} files ({', '.join(sorted(groups)[:3])})"
        raise CheckpointError(f"{repo}:{tag}: {what} of {repo} carries {tag!r} in its name; its GGUF files include "
                              f"{', '.join(names)}")
    (parts,) = groups.values()
    parts = sorted(parts)
    m = SPLIT_PART.search(parts[0])
    if m is not None and len(parts) != int(m.group(2)):
        raise CheckpointError(f"{repo}:{tag} is split in {int(m.group(2))} parts, but the repository lists "
                              f"{len(parts)} of them")
    return parts


def hub_gguf_model(name: str, revision: str | None = None) -> tuple[GGUFModel, str]:
    """(the model the hub's GGUF file holds, where it is: "endpoint/repo@commit file")."""
    from huggingface_hub import HfApi, constants

    from vramplan.planner.errors import ModelNotFoundError, VramplanError
    from vramplan.runtime.hub import HUB_TIMEOUT_S, _read_range, hub_error, hub_id_problem, within_deadline

    m = HUB_GGUF_RE.fullmatch(name)
    repo, tag = m["repo"], m["tag"]
    endpoint = constants.ENDPOINT
    if (problem := hub_id_problem(repo)) is not None:
        raise ModelNotFoundError(f"no model {repo!r}: not a valid hub id ({problem})")
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{name}: a GGUF file on the hub, and HF_HUB_OFFLINE is set (its header is read "
                                 "from the hub each time; a downloaded file plans as --model PATH.gguf)")
    try:
        info = within_deadline(lambda: HfApi().model_info(repo, revision=revision, timeout=HUB_TIMEOUT_S),
                               f"the model info of {repo}", endpoint)
        files = choose_files(repo, tag, [s.rfilename for s in info.siblings or ()])
        commit = info.sha or revision or "main"
        sources = [_source(repo, commit, f, endpoint, _read_range, within_deadline) for f in files]
    except VramplanError:
        raise
    except Exception as e:  # the hub's own errors, as runtime/hub.py words them
        raise hub_error(e, repo, revision, endpoint) from None
    where = f"{endpoint}/{repo}/{files[0]}" + (f" (+{len(files) - 1} parts)" if len(files) > 1 else "")
    return read_gguf_model(sources, where), where


def _source(repo, commit, filename, endpoint, read_range, within_deadline):
    """(read, size, name) for planner/gguf_model.py: blocks fetched by range reads as the parser asks, each once."""
    where = f"{endpoint}/{repo}/{filename}"
    blocks: dict[int, bytes] = {}

    def block(i: int) -> bytes:
        if i not in blocks:
            blocks[i] = within_deadline(lambda: read_range(repo, commit, filename, endpoint, i * GGUF_READ_BLOCK,
                                                           GGUF_READ_BLOCK, where)[0], where, endpoint)
        return blocks[i]

    first, size = within_deadline(lambda: read_range(repo, commit, filename, endpoint, 0, GGUF_READ_BLOCK, where),
                                  where, endpoint)
    blocks[0] = first

    def read(offset: int, n: int) -> bytes:
        out = bytearray()
        while n > 0 and offset < size:
            i, at = divmod(offset, GGUF_READ_BLOCK)
            chunk = block(i)[at:at + n]
            if not chunk:
                break
            out += chunk
            offset, n = offset + len(chunk), n - len(chunk)
        return bytes(out)

    return read, size, where
