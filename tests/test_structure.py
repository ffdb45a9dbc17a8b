"""The shape of the code, checked: the planner is pure (by its imports, lazy ones included, and by what it calls),
every quantization scheme has a runtime half, and no source file outgrows a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANNER = sorted((ROOT / "planner").rglob("*.py"))
# What the planner may not import: the heavy libraries, anything that touches hardware or the network, and the
# layers above it.
FORBIDDEN_IN_PLANNER = {"torch", "transformers", "bitsandbytes", "optimum", "accelerate", "safetensors",
                        "huggingface_hub", "pynvml", "psutil", "numpy", "runtime", "cli", "cli_errors", "cli_inputs",
                        "render",
                        "requests", "urllib", "http", "socket", "subprocess"}
# Calls that write or move files: pathlib methods, and os / shutil / tempfile functions.
PATH_WRITES = {"write_text", "write_bytes", "mkdir", "touch", "unlink", "rmdir", "rename", "symlink_to"}
MODULE_WRITES = {"os": {"replace", "rename", "remove", "unlink", "makedirs", "mkdir", "rmdir", "symlink"},
                 "shutil": {"copy", "copy2", "copyfile", "copytree", "move", "rmtree"},
                 "tempfile": {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory"}}
MAX_LINES = 800


# Everything installs under one package, `vramplan` (pyproject's package-dir maps it to the repository root), so
# `vramplan.runtime` is the runtime: the checks below name modules as the repository does (runtime, cli, ...).
REPO_MODULES = {"planner", "runtime", "profiles", "cli", "cli_errors", "cli_inputs", "render"}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "vramplan" and len(parts) > 1 else parts[0]


def _absolute(place: Path, node: ast.ImportFrom) -> list[str]:
    """What a `from ... import` names, absolute and under `vramplan` (relative ones resolved from the file's place in
    the repository)."""
    if not node.level:
        return [node.module or ""]
    package = ["vramplan", *place.parent.parts]
    base = package[:len(package) - node.level + 1]
    if node.module:
        return [".".join([*base, node.module])]
    return [".".join([*base, a.name]) for a in node.names]  # `from .. import runtime`


def _imports(path: Path, place: Path | None = None) -> set[str]:
    place = place or path.relative_to(ROOT)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # ast.walk: imports inside functions too
        if isinstance(node, ast.Import):
            names |= {_top(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            full = _absolute(place, node)
            names |= {_top(m) for m in full if m}
            if full == ["vramplan"]:  # `from vramplan import runtime`
                names |= {a.name for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(_top(arg.value))
    return names - {"vramplan"}


@pytest.mark.parametrize("path", PLANNER, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_planner_imports_nothing_impure(path):
    bad = _imports(path) & FORBIDDEN_IN_PLANNER
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", PLANNER, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_planner_writes_no_files(path):
    _assert_writes_nothing(path)


def _assert_writes_nothing(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = getattr(func, "attr", None) or getattr(func, "id", None)
        owner = getattr(getattr(func, "value", None), "id", None)
        assert name not in PATH_WRITES and name not in MODULE_WRITES.get(owner, ()), (
            f"{path}:{node.lineno} calls {owner + '.' if owner else ''}{name}()")
        if name == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                  None)
            text = mode.value if isinstance(mode, ast.Constant) else "r"
            assert not set(str(text)) & set("wax+"), f"{path}:{node.lineno} opens for writing"


def test_a_planted_impurity_is_caught(tmp_path):
    """The two checks above can fail: an import inside a function, and a write."""
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    import torch.nn\n    return __import__('vramplan.runtime.probe')\n")
    assert {"torch", "runtime"} <= _imports(sneaky, place=Path("planner/sneaky.py"))
    for line in ("from vramplan import cli", "from vramplan.render import out", "from ..runtime import load",
                 "from .. import runtime"):
        sneaky.write_text(line + "\n")
        assert _imports(sneaky, place=Path("planner/sneaky.py")) & FORBIDDEN_IN_PLANNER, line
    sneaky.write_text("from ..choice import Choice\nfrom . import speed\n")
    assert not _imports(sneaky, place=Path("planner/engines/sneaky.py")) & FORBIDDEN_IN_PLANNER
    writer = tmp_path / "writer.py"
    writer.write_text("import os\ndef f(p):\n    os.replace(p, p + '.bak')\n")
    with pytest.raises(AssertionError, match="calls os.replace"):
        _assert_writes_nothing(writer)


def test_every_scheme_has_a_runtime_half():
    pytest.importorskip("torch")
    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.runtime.kvcache import BACKENDS as KV_BACKENDS
    from vramplan.runtime.quantize import BACKENDS

    assert {s.backend for s in SCHEMES.values()} <= set(BACKENDS)
    assert {k.backend for k in KV_SCHEMES.values()} <= set(KV_BACKENDS)
    for s in SCHEMES.values():
        if s.backend == "bnb" and s.bits == 4:
            assert s.variant in ("nf4", "fp4") and s.group_size == 64
        if s.backend == "bnb" and s.bits == 8:
            assert s.outlier_threshold is not None
    for k in KV_SCHEMES.values():
        if k.backend == "quanto":
            assert k.nbits in (2, 4) and k.group_size and k.residual_tokens


def test_no_source_file_outgrows_a_reader():
    sources = [*PLANNER, *(ROOT / "runtime").rglob("*.py"), *(ROOT / "bench").glob("*.py"), ROOT / "cli.py",
               ROOT / "cli_errors.py", ROOT / "cli_inputs.py", ROOT / "render.py"]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _module_graph(package: str) -> dict[str, set[str]]:
    """Which modules of `package` each of its modules imports (lazy imports inside functions included)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                submodules = {f"{module}.{a.name}" for a in node.names} & set(files)
                deps |= submodules or {module}  # `from . import x` of a submodule x needs x, not the package's body
        deps = {d.removeprefix("vramplan.") for d in deps}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), None)


SOURCES = [p for p in ROOT.rglob("*.py") if not {"tests", ".git", "build"} & set(p.relative_to(ROOT).parts[:1])
           and "data" not in p.relative_to(ROOT).parts and ".egg" not in str(p)] + sorted((ROOT / "tests").glob("*.py"))


def test_every_import_goes_through_the_vramplan_package():
    """`planner`, `runtime`, `render`... are also other projects' names on the index: vramplan's own code imports them
    as vramplan.planner etc. (or relatively), never by the bare name, which an installed vramplan does not provide."""
    bare = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            hits = [n for n in names if n.split(".")[0] in REPO_MODULES]
            if hits:
                bare.setdefault(str(path.relative_to(ROOT)), []).extend(hits)
    assert not bare, bare


@pytest.mark.parametrize("package", ["runtime", "planner"])
def test_no_import_cycles(package):
    """Each module can be read on its own: none imports one that imports it back, lazily or not (dummy.py and load.py
    once did: the shared model facts now live in runtime/modeling.py)."""
    assert _cycle(_module_graph(package)) is None, " -> ".join(_cycle(_module_graph(package)))


def test_an_import_cycle_is_caught():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _private_imports(path: Path) -> list[str]:
    """`from X import _name` of another module's private name (lazy imports included)."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


@pytest.mark.parametrize("path", sorted((ROOT / "planner" / "engines").glob("*.py")), ids=lambda p: p.name)
def test_no_engine_imports_another_modules_private_names(path):
    """An engine uses what the planner and the other engines offer publicly (llama.cpp once took search._choose)."""
    assert not _private_imports(path)


def test_a_private_import_is_caught(tmp_path):
    planted = tmp_path / "engine.py"
    planted.write_text("from ..search import _choose as choose\nfrom .common import Export\n")
    assert _private_imports(planted) == ["search._choose"]


def test_records_share_methods_that_behave_as_dataclass_generates():
    """planner.record's shared __repr__/__eq__/__hash__ against dataclass's generated ones, over every field flag and
    inheritance; and every frozen dataclass the planner defines is a record, so it has exactly those."""
    import importlib
    import pkgutil
    import sys
    from dataclasses import FrozenInstanceError, dataclass, field, is_dataclass, replace

    import vramplan.planner as planner_pkg
    from vramplan.planner.record import FROZEN, SHARED, record

    def variants(decorate, kw):
        @decorate
        class Base:
            a: int
            b: str = field(default="x", repr=False)
            c: tuple = field(default=(1, 2), compare=False)
            d: float = field(default=0.5, hash=False)
            e: list = field(default_factory=list, compare=False, hash=False)
            f: int = field(default=3, hash=True, compare=True)

        @decorate
        class Child(Base):
            g: str = "y"

        return Base, Child

    def plain(c):
        return dataclass(frozen=True)(c)

    for (RB, RC), (PB, PC) in [(variants(record, {}), variants(plain, {}))]:
        for args in [(1,), (1, "z"), (2, "x", (3,), 0.25), (1, "x", (1, 2), 0.5, [1], 4)]:
            for (r_cls, p_cls) in ((RB, PB), (RC, PC)):
                r, p = r_cls(*args), p_cls(*args)
                assert repr(r).replace(r_cls.__qualname__, "X") == repr(p).replace(p_cls.__qualname__, "X")
                assert hash(r) == hash(p)
                r2, p2 = replace(r, c=(9,), e=[9]), replace(p, c=(9,), e=[9])
                assert (r == r2) == (p == p2) and (r == replace(r, a=7)) == (p == replace(p, a=7))
                assert hash(r2) == hash(p2)
                with pytest.raises(FrozenInstanceError):
                    r.a = 5
                with pytest.raises(FrozenInstanceError):
                    r.z = 5
                with pytest.raises(FrozenInstanceError):
                    del r.b
        assert RB(1) != RC(1) and RC(1) != RB(1) and (RB(1) == 1) is False  # another class: NotImplemented
        for cls in (RB, PB):  # a subclass that is not a dataclass: its fields frozen, other attributes its own
            class Loose(cls):
                pass
            o = Loose(1)
            o.z = 5
            del o.z
            with pytest.raises(FrozenInstanceError):
                o.a = 2
    with pytest.raises(TypeError, match="a record shares them"):
        @record
        class Own:
            x: int

            def __repr__(self):
                return "own"

    frozen = []
    for info in pkgutil.walk_packages(planner_pkg.__path__, "vramplan.planner."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == module.__name__ and is_dataclass(obj) \
                    and obj.__dataclass_params__.frozen:
                frozen.append(obj)
    assert len(frozen) > 60
    if sys.version_info[:2] in ((3, 11), (3, 12)):
        assert FROZEN  # the frozen pair shared where dataclass lets it be
    not_records = [c.__qualname__ for c in frozen
                   if any(getattr(c, k) is not f for k, f in {**SHARED, **FROZEN}.items())]
    assert not not_records, f"frozen dataclasses that are not records: {not_records}"


def test_every_backend_the_speed_model_uses_is_a_calibration_backend():
    """A calibration entry names its backend from a closed list (planner.hardware.CALIBRATION_BACKENDS and the
    attention prefixes): every name the speed model looks up or a fit writes is on it, and a typo is refused."""
    from vramplan.planner import speed
    from vramplan.planner.engines import llamacpp
    from vramplan.planner.hardware import ATTENTION_IMPLS, ATTENTION_PREFIXES, _known_backend
    from vramplan.planner.quant import SCHEMES
    from vramplan.planner.sources import catalog, model_spec

    used = {s.backend for s in SCHEMES.values()} | {speed.COMPILED_BACKEND, speed.EXPERTS_BACKEND,
                                                     speed.KV_UPDATE_BACKEND, *llamacpp.LLAMA_CPP_BACKENDS}
    used |= {p + model_spec(e.id).attention_impl for e in catalog() for p in ATTENTION_PREFIXES}
    assert all(_known_backend(b) for b in used), sorted(b for b in used if not _known_backend(b))
    assert speed.PREFILL_ATTENTION_BACKEND + "-" in ATTENTION_PREFIXES and "llama.cpp" in ATTENTION_IMPLS
    assert not _known_backend("bnbb") and not _known_backend("attn-flash")
