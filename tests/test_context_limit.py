"""A context beyond what the model is made for is refused (exit 2) unless asked for; rope scaling that names the
original length it extends makes a longer context valid; one that does not (gemma-3, Llama-3.1) extends nothing."""

from __future__ import annotations

import pytest
from vramplan import cli
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.errors import PlanError
from vramplan.planner.modelspec import context_limit
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec

QWEN = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}
HW = resolve_profile("rtx-4090")[0]


def test_gemma2_at_32k_is_refused_unless_allowed():
    spec = model_spec("google/gemma-2-9b")
    assert context_limit(spec) == (8192, "max_position_embeddings 8192")
    with pytest.raises(PlanError, match=r"context 32768 exceeds .* \(max_position_embeddings 8192\).*"
                                        r"request.allow_context_overflow"):
        plan(spec, HW, Request(context=32768))
    allowed = plan(spec, HW, Request(context=32768, allow_context_overflow=True))
    assert allowed.fits and any("the overflow is allowed" in w for w in allowed.warnings)
    assert allowed.to_dict()["request"]["allow_context_overflow"] is True
    assert not any("max_position_embeddings" in w for w in plan(spec, HW, Request(context=8192)).warnings)


def test_yarn_with_its_original_length_extends_the_context():
    yarn = {**QWEN, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    spec = spec_from_config(yarn, name="qwen-yarn")
    assert context_limit(spec) == (131072, "rope_scaling yarn x4 of 32768 tokens")
    p = plan(spec, HW, Request(context=131072))
    assert p.fits and any("within the rope_scaling yarn x4" in w for w in p.warnings)
    with pytest.raises(PlanError, match="131073"):
        plan(spec, HW, Request(context=131073))
    # transformers 5 writes rope_parameters, with rope_type
    v5 = {**QWEN, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}}
    assert context_limit(spec_from_config(v5, name="v5"))[0] == 65536


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 8.0},  # gemma-3: already counted in max_position_embeddings
    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},  # Llama-3.1: 131072 given
    {"rope_type": "default"},
])
def test_scalings_already_counted_extend_nothing(scaling):
    spec = spec_from_config({**QWEN, "rope_scaling": scaling}, name="m")
    assert context_limit(spec) == (32768, "max_position_embeddings 32768")


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_refuses_in_one_line_with_exit_2(capsys):
    base = ("plan", "--model", "google/gemma-2-9b", "-H", "rtx-4090", "--context", "32k")
    code, _, err = _main(capsys, *base)
    assert code == 2 and err.strip().startswith("error: context 32768 exceeds") and len(err.strip().splitlines()) == 1
    assert "pass --allow-context-overflow" not in err and "set --allow-context-overflow" in err  # the CLI's words
    code, _, _ = _main(capsys, *base, "--allow-context-overflow", "--json")
    assert code == 0
    code, _, err = _main(capsys, *base, "--engine", "llama.cpp")
    assert code == 2 and "exceeds" in err  # llama.cpp's planning refuses it the same way


def test_the_default_context_is_cut_to_a_shorter_model(capsys, tmp_path):
    (tmp_path / "config.json").write_text(__import__("json").dumps({**QWEN, "max_position_embeddings": 256}))
    code, out, err = _main(capsys, "plan", "--model", str(tmp_path), "-H", "rtx-4090", "--json")
    assert code == 0 and __import__("json").loads(out)["request"]["context"] == 256
    assert "256 tokens" in err and "default 4k is longer" in err
    code, _, err = _main(capsys, "plan", "--model", str(tmp_path), "-H", "rtx-4090", "--context", "4k")
    assert code == 2 and "exceeds" in err  # asked for explicitly: refused
