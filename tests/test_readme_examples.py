"""Every `vramplan` example in the README and in docs/*.md, as written (issue 40): the planning ones (plan, inspect,
models, profiles) run in this process with the files they name made for them, and end without a usage error (0, or 1
where the page says nothing fits); the ones that load models or measure (run, calibrate, probe) or reach the hub are
parsed by the CLI's own option parser, which is where a usage error would come from."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer

from cli_helpers import run_cli
from conftest import tiny_config_dict
from test_gguf_model import LLAMA, _q4_k_m, metadata, write_gguf
from vramplan import cli

ROOT = Path(__file__).resolve().parents[1]
RUN_HERE = ("plan", "inspect", "models", "profiles")
HUB = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_examples(pages: list[Path] = PAGES) -> list[str]:
    """The `vramplan ...` lines of the code blocks (fenced or indented) of the README and the docs pages, in that
    order, continuations joined, the shell comment and the prompt ($) dropped."""
    out = []
    for page in pages:
        fenced, pending = False, ""
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
                continue
            text = line.strip() if fenced or line.startswith("    ") else ""
            if pending:
                text, pending = pending + " " + text, ""
            if text.endswith("\\"):
                pending = text[:-1].rstrip()
                continue
            text = text.removeprefix("$ ")
            if re.match(r"^(echo .*\| )?vramplan ", text):
                out.append(re.sub(r"\s+#\s.*$", "", text.split("| ", 1)[-1]))
    return out


EXAMPLES = readme_examples()


def test_a_usage_error_is_caught_by_the_parse():
    with pytest.raises(Exception, match="No such option"):
        _parses(["run", "--model", "x", "--no-such-option"])
    _parses(["run", "--model", "x", "--dummy-weights"])


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 20 and any(e.startswith("vramplan plan --model llama-3.1-70b") for e in EXAMPLES)
    readme = readme_examples([ROOT / "README.md"])
    assert len(readme) >= 10 and readme[0].startswith("vramplan plan --model ")  # the README keeps its own examples
    assert len(set(EXAMPLES)) == len(EXAMPLES), "an example is given twice"


def test_the_docs_pages_are_read_and_linked():
    """docs/*.md count (their examples run too), and every relative link of the README and the docs pages (a page,
    a result file, the picture) names a file that exists; every docs page is linked from the README."""
    readme = (ROOT / "README.md").read_text()
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs and len(readme_examples(docs)) >= 10
    for page in [ROOT / "README.md", *docs]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#", 1)[0]
            if path and not re.match(r"^[a-z]+:", path):
                assert (page.parent / path).exists(), f"{page.name}: {target}"
    assert all(f"](docs/{d.name}" in readme for d in docs), "a docs page the README does not link"


def _model_of(args: list[str]) -> str | None:
    for flag in ("--model", "-m"):
        if flag in args:
            return args[args.index(flag) + 1]
    return None


def _files_for(tmp_path: Path, args: list[str]) -> None:
    """The files an example names, made in the directory it runs in."""
    model = _model_of(args) or ""
    if model.startswith("./") and model.endswith(".gguf"):
        write_gguf(tmp_path / model, "llama", _q4_k_m(LLAMA), metadata("llama", LLAMA, "Q4_K_M"))
    elif model.startswith("./"):
        (tmp_path / model).mkdir(parents=True, exist_ok=True)
        (tmp_path / model / "config.json").write_text(json.dumps(tiny_config_dict("llama")))
    text = (ROOT / "profiles" / "h100-sxm.yaml").read_text()
    for a in args:
        if a.startswith("team/") and a.endswith(".yaml") and "*" not in a:
            (tmp_path / "team").mkdir(exist_ok=True)
            (tmp_path / a).write_text(text.replace("name: h100-sxm", f"name: {Path(a).stem}")
                                      .replace("count: 1", "count: 8"))
        elif "*" in a:
            (tmp_path / "team").mkdir(exist_ok=True)
            (tmp_path / "team" / "a100-node.yaml").write_text(text.replace("name: h100-sxm", "name: a100-node"))


def _left(ctx) -> list[str]:
    """What a group's context leaves for its subcommand (click keeps it in protected_args or _protected_args)."""
    return [*(getattr(ctx, "protected_args", None) or getattr(ctx, "_protected_args", None) or []), *ctx.args]


def _parses(args: list[str]) -> None:
    """The CLI's option parser over the example (click's make_context: a usage error raises here)."""
    group = typer.main.get_command(cli.app)
    ctx = group.make_context("vramplan", list(args), resilient_parsing=False)
    name, sub, rest = group.resolve_command(ctx, _left(ctx))
    if hasattr(sub, "resolve_command"):  # a group (profiles): its subcommand
        sctx = sub.make_context(name, rest, parent=ctx)
        name, sub, rest = sub.resolve_command(sctx, _left(sctx))
    sub.make_context(name, rest, parent=ctx)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e[:70] for e in EXAMPLES])
def test_every_readme_example_runs_as_written(example, tmp_path, monkeypatch, capsys):
    args = shlex.split(example)[1:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    model = _model_of(args)
    hub_model = model is not None and HUB.match(model) and not model.startswith(("meta-llama/", "Qwen/"))
    if args[0] not in RUN_HERE or hub_model or "ORG/NAME" in args:
        _parses(args)
        return
    _files_for(tmp_path, args)
    code, out, err = run_cli(capsys, *args)
    assert code in (0, 1), f"{example}\n{err}"
    assert "usage" not in err.lower() and "Traceback" not in err and "internal error" not in err, err
