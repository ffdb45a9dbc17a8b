"""What the hostile audit of issue 36 found in model resolution and model files, each refused in one line (exit 2)
or fixed: hub-id typos huggingface_hub refuses, a name no path can have, an absurd hub deadline, a failed header
read that left the next call planning from config.json alone without a word, fp8 block sizes of zero, JSON nested
100,000 deep (safetensors header, index, --add-runs), and layer-index lists naming layers the model lacks.

The first table runs the real CLI in-process, offline (no hub is ever asked). The hub tests run the CLI in a
subprocess against the fake hub on loopback (tests/fake_hub.py): huggingface_hub reads its endpoint at import.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from fake_hub import TINY_LLAMA, FakeHub, cli, exact_bytes, hub_env, inspect, llama_files, one_line_error

INVALID_HUB_IDS = {  # each refused by huggingface_hub 2.4's validate_repo_id, with vramplan's reason
    "org/..": "'--' and '..' are not allowed",
    "a--b/c": "'--' and '..' are not allowed",
    "a/b..c": "'--' and '..' are not allowed",
    "a/-b": "org and name cannot start or end with '-' or '.'",
    "a/b-": "org and name cannot start or end with '-' or '.'",
    "a/b.git": "it cannot end in '.git'",
}
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
TINY_QWEN3_MOE = {**TINY, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
TINY_LLAMA4_TEXT = {**TINY, "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
                    "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1}
# Deeper than any recursion limit: json and PyYAML recurse once (or more) per level.
DEEP_JSON_LEVELS = 100_000
DEEP_YAML_LEVELS = 20_000  # PyYAML's scanner is slow: deep enough, and fast


def deep_list(levels: int) -> str:
    return "[" * levels + "]" * levels


def model_dir(tmp_path: Path, config: dict, files: dict[str, bytes] | None = None) -> str:
    """A model directory with this config.json and these other files."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    for name, data in (files or {}).items():
        (d / name).write_bytes(data)
    return str(d)


def safetensors_file(header: bytes, data: bytes = b"") -> bytes:
    """A safetensors file with this header text (whatever it holds) and data."""
    return len(header).to_bytes(8, "little") + header + data


def written(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


PLAN = ("plan", "-H", "rtx-4090", "--model")

# ------------------------------------------------------------------ the reliability matrix: argv -> one line, exit 2
# Each row: (id, argv built in tmp_path, what the error line says).
MATRIX = [
    *[(f"hub id {name}", lambda t, n=name: [*PLAN, n], f"not a valid hub id either ({why})")
      for name, why in INVALID_HUB_IDS.items()],
    ("--revision on an invalid hub id", lambda t: [*PLAN, "a/b-", "--revision", "main"],
     "--revision applies to a hub id (org/name), not to 'a/b-' (org and name cannot start or end with '-' or '.')"),
    ("name over 255 bytes", lambda t: [*PLAN, "x" * 300], "name too long (300 bytes)"),
    ("hub id of 300 characters", lambda t: [*PLAN, "acme/" + "x" * 300],
     "not a valid hub id either (org and name are at most 96 characters each)"),
    ("path over PATH_MAX", lambda t: [*PLAN, "a/" * 3000], "name too long (6000 bytes)"),
    ("unknown ~user", lambda t: [*PLAN, "~no-such-user-vramplan/model"], "no such user's home directory"),
    ("fp8 weight_block_size [0, 0]", lambda t: [*PLAN, model_dir(t, {**TINY, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [0, 0]}})],
     "quantization_config.weight_block_size must be two positive integers (the rows and columns one scale covers, "
     "e.g. [128, 128]), got [0, 0]"),
    ("fp8 weight_block_size [128]", lambda t: [*PLAN, model_dir(t, {**TINY, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128]}})], "got [128]"),
    ("safetensors header nested 100,000 deep", lambda t: [*PLAN, model_dir(t, TINY, {
        "model.safetensors": safetensors_file(deep_list(DEEP_JSON_LEVELS).encode())})],
     "model.safetensors: corrupt safetensors header (JSON nested too deeply)"),
    ("safetensors header with a 5000-digit integer", lambda t: [*PLAN, model_dir(t, TINY, {
        "model.safetensors": safetensors_file(b'{"a": ' + b"1" * 5000 + b"}")})],
     "model.safetensors: corrupt safetensors header (Exceeds the limit"),
    ("safetensors header with a negative dimension", lambda t: [*PLAN, model_dir(t, TINY, {
        "model.safetensors": safetensors_file(json.dumps({"w": {"dtype": "BF16", "shape": [-2, -2],
                                                                "data_offsets": [0, 8]}}).encode(), bytes(8))})],
     "corrupt safetensors header entry 'w'"),
    ("safetensors index nested 100,000 deep", lambda t: [*PLAN, model_dir(t, TINY, {
        "model.safetensors.index.json": deep_list(DEEP_JSON_LEVELS).encode()})],
     "model.safetensors.index.json: unreadable index (JSON nested too deeply)"),
    ("mlp_only_layers [1000]", lambda t: [*PLAN, model_dir(t, {**TINY_QWEN3_MOE, "mlp_only_layers": [1000]})],
     "field 'mlp_only_layers' lists layer 1000, but the model has 2 layers (0 to 1)"),
    ("mlp_only_layers [-1]", lambda t: [*PLAN, model_dir(t, {**TINY_QWEN3_MOE, "mlp_only_layers": [-1]})],
     "field 'mlp_only_layers' lists layer -1"),
    ("moe_layers [2] of 2 layers", lambda t: [*PLAN, model_dir(t, {**TINY_LLAMA4_TEXT, "moe_layers": [0, 2]})],
     "field 'moe_layers' lists layer 2, but the model has 2 layers (0 to 1)"),
    ("no_rope_layers flag 2", lambda t: [*PLAN, model_dir(t, {**TINY_LLAMA4_TEXT, "no_rope_layers": [1, 2]})],
     "no_rope_layers must list one flag (0 or 1) per layer (2)"),
    ("layer_types of objects (no builder)", lambda t: [*PLAN, model_dir(t, {
        **TINY, "model_type": "acme_lm", "layer_types": [{"full": 1}, {"full": 1}]})],
     "field 'layer_types' must list one string per layer"),
    ("--add-runs JSON nested 100,000 deep", lambda t: ["calibrate", "--add-runs", written(
        t, "runs.json", deep_list(DEEP_JSON_LEVELS))], "runs.json: not a file of calibration runs (nested too deeply)"),
    ("--add-runs YAML nested 20,000 deep", lambda t: ["calibrate", "--add-runs", written(
        t, "runs.yaml", deep_list(DEEP_YAML_LEVELS))],
     "runs.yaml: not a file of calibration runs (ScannerError: while increasing flow level exceeded maximum nesting"),
]


@pytest.mark.parametrize("argv, says", [pytest.param(argv, says, id=name) for name, argv, says in MATRIX])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, monkeypatch, argv, says):
    isolate(tmp_path, monkeypatch, offline_hub=True)
    code, out, err = run_cli(capsys, *argv(tmp_path))
    assert says in assert_one_line_error(code, err) and out == ""


# ------------------------------------------------------------------ 1. hub ids: huggingface_hub's rules, before asking
HUB_ID_SAMPLES = [*INVALID_HUB_IDS, "acme/tiny-llama", "Qwen/Qwen2.5-0.5B", "a/b", "_a/b_", "a.b/c.d", "a-b/c_d",
                  "a/.b", "a/b.", ".a/b", "a_/b", "a/b--", "a/b.git.x", "a/" + "x" * 96, "a/" + "x" * 97,
                  "x" * 96 + "/b", "x" * 97 + "/b", "a/b c", "a/bé", "a/", "/b", "a/b\n", "a/b!"]


@pytest.mark.parametrize("name", HUB_ID_SAMPLES)
def test_vramplans_hub_id_check_is_huggingface_hubs(name):
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from vramplan.runtime.hub import hub_id_problem

    try:
        validate_repo_id(name)
        hub_accepts = True
    except HFValidationError:
        hub_accepts = False
    assert (hub_id_problem(name) is None) == hub_accepts, hub_id_problem(name)


def test_huggingface_hubs_validation_error_is_one_line_not_internal():
    """The safety net: an HFValidationError that reaches hub_error is a ModelNotFoundError, not an internal error."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from vramplan.planner.errors import ModelNotFoundError
    from vramplan.runtime.hub import hub_error

    with pytest.raises(HFValidationError) as raised:
        validate_repo_id("a/b.git")
    e = hub_error(raised.value, "a/b.git", None, "http://127.0.0.1:9")
    assert isinstance(e, ModelNotFoundError) and e.exit_code == 2
    assert str(e) == "no model 'a/b.git': not a valid hub id or revision (Repo_id cannot end by '.git': 'a/b.git'.)"


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


@pytest.fixture
def env(tmp_path, hub):
    return hub_env(tmp_path, hub)


def test_invalid_hub_ids_are_refused_before_the_hub_is_asked(hub, env):
    for name, why in INVALID_HUB_IDS.items():
        err = one_line_error(cli(env, "plan", "--model", name, "-H", "rtx-4090"))
        assert f"no model {name!r}" in err and f"not a valid hub id either ({why})" in err
    assert not hub.log


# ------------------------------------------------------------------ 4. the hub deadline's bound
def test_an_absurd_hub_deadline_is_refused_before_asking(hub, env):
    files, _ = llama_files()
    hub.add("acme/tiny-llama", files)
    err = one_line_error(cli(env, "plan", "--model", "acme/tiny-llama", "-H", "rtx-4090",
                             VRAMPLAN_HUB_DEADLINE_S="1e20"))
    assert "$VRAMPLAN_HUB_DEADLINE_S='1e20': expected a number of seconds > 0 and at most 86400 (a day)" in err
    assert not hub.log
    r = cli(env, "plan", "--model", "acme/tiny-llama", "-H", "rtx-4090", VRAMPLAN_HUB_DEADLINE_S="86400")
    assert r.returncode == 0, r.stderr  # a day is taken


# ------------------------------------------------------------------ 2. a failed header read leaves no config behind
def snapshots_with_config(tmp_path: Path, repo: str) -> list[Path]:
    """The HF cache's snapshots of `repo` that hold a config.json: what a later call would plan from."""
    root = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots"
    return sorted(p for p in root.glob("*") if (p / "config.json").is_file())


def corrupt_llama_files() -> dict[str, bytes]:
    files, _ = llama_files()
    return {**files, "model.safetensors": (30).to_bytes(8, "little") + b"{this is not json, truncated" + bytes(100)}


def test_a_corrupt_header_then_a_good_one_is_fetched_again(hub, env, tmp_path):
    hub.add("acme/flaky", corrupt_llama_files())
    err = one_line_error(cli(env, "plan", "--model", "acme/flaky", "-H", "rtx-4090"))
    assert "corrupt safetensors header" in err and "acme/flaky/model.safetensors" in err
    assert not hub.requests(file="config.json")  # config.json comes last: never fetched
    assert snapshots_with_config(tmp_path, "acme/flaky") == []
    # offline, nothing was cached to plan from: said so, not a plan from the config alone
    err = one_line_error(cli(env, "plan", "--model", "acme/flaky", "-H", "rtx-4090", HF_HUB_OFFLINE="1"))
    assert "not in it" in err
    # the hub is fixed (a new commit): the next online call reads the headers, exactly
    files, _ = llama_files()
    repo = hub.add("acme/flaky", files)
    asked = len(hub.log)
    facts = inspect(env, "acme/flaky")
    assert facts["weight_bytes"]["checkpoint"] == exact_bytes()
    assert [q.range for q in hub.log[asked:] if q.path.endswith(".safetensors")] == [
        "bytes=0-7", f"bytes=8-{7 + int.from_bytes(files['model.safetensors'][:8], 'little')}"]
    assert [p.name for p in snapshots_with_config(tmp_path, "acme/flaky")] == [repo.sha]


def test_a_header_read_that_times_out_leaves_nothing_to_plan_from(hub, env, tmp_path):
    files, _ = llama_files()
    hub.add("acme/slow", files, range_delay_s=3.0)
    err = one_line_error(cli(env, "plan", "--model", "acme/slow", "-H", "rtx-4090", VRAMPLAN_HUB_DEADLINE_S="1"))
    assert "the safetensors header of acme/slow/model.safetensors (Timeout" in err
    assert snapshots_with_config(tmp_path, "acme/slow") == []
    hub.add("acme/slow", files)  # the hub answers again: the headers are read this time
    assert inspect(env, "acme/slow")["weight_bytes"]["checkpoint"] == exact_bytes()


MOVED = "b" * 40


class MovingHub(FakeHub):
    """main moves to commit MOVED right after a model info is answered (a push between two requests)."""

    def _info(self, h, req, repo_id: str, rev: str) -> None:
        super()._info(h, req, repo_id, rev)
        self.repos[repo_id].refs.update({"main": MOVED, MOVED: MOVED})


def test_a_branch_that_moves_while_read_is_read_at_its_new_commit(tmp_path):
    """The model info names one commit, config.json comes from the next: the headers are read again at the commit
    config.json is cached under, so the next call (offline) finds them."""
    files, _ = llama_files()
    with MovingHub() as hub:
        repo = hub.add("acme/moving", files)
        env = hub_env(tmp_path, hub)
        assert inspect(env, "acme/moving")["weight_bytes"]["checkpoint"] == exact_bytes()
        infos = [q.path for q in hub.requests(method="GET") if q.path.startswith("/api/models/")]
        assert infos == ["/api/models/acme/moving", f"/api/models/acme/moving/revision/{MOVED}"]
        headers = {q.path.split("/")[4] for q in hub.requests(file="model.safetensors")}
        assert headers == {repo.sha, MOVED}
        facts = inspect(env, "acme/moving", HF_HUB_OFFLINE="1")
    assert facts["weight_bytes"]["checkpoint"] == exact_bytes() and MOVED in facts["source"]
    assert (tmp_path / "vramplan" / "hub" / "models--acme--moving" / f"{MOVED}.json").is_file()


CONFIG_ONLY = "planned from config.json only: the safetensors headers of acme/tiny-llama were not read"


def test_a_cached_config_without_headers_says_so_every_time_until_fetched(hub, env, tmp_path):
    """Headers read but not cached (vramplan's cache directory is a file): the next calls plan from the HF cache's
    config.json alone, and each says so; --revision main asks the hub again and caches them."""
    files, _ = llama_files()
    hub.add("acme/tiny-llama", files)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    first = cli(env, "plan", "--model", "acme/tiny-llama", "-H", "rtx-4090", "--json",
                VRAMPLAN_CACHE_DIR=str(blocked))
    assert first.returncode == 0, first.stderr
    assert "headers not cached" in json.loads(first.stdout)["model"]["source"]
    for offline in ("1", "0"):  # from the HF cache, offline or not: the hub is not asked, and the plan says why
        asked = len(hub.log)
        r = cli(env, "plan", "--model", "acme/tiny-llama", "-H", "rtx-4090", "--json",
                VRAMPLAN_CACHE_DIR=str(blocked), HF_HUB_OFFLINE=offline)
        assert r.returncode == 0, r.stderr
        assert CONFIG_ONLY in r.stderr and "`--revision main` asks the hub for them" in r.stderr
        assert json.loads(r.stdout)["model"]["source"].endswith("config.json only, no safetensors headers")
        assert len(hub.log) == asked
    r = cli(env, "inspect", "--model", "acme/tiny-llama", "--revision", "main", "--json")  # a writable cache now
    assert r.returncode == 0 and json.loads(r.stdout)["weight_bytes"]["checkpoint"] == exact_bytes(), r.stderr
    r = cli(env, "inspect", "--model", "acme/tiny-llama", "--json", HF_HUB_OFFLINE="1")
    assert r.returncode == 0 and CONFIG_ONLY not in r.stderr, r.stderr
    assert json.loads(r.stdout)["weight_bytes"]["checkpoint"] == exact_bytes()


def test_a_hub_repo_without_safetensors_plans_from_its_config_and_says_so(hub, env):
    hub.add("acme/config-only", {"config.json": json.dumps(TINY_LLAMA).encode(), "README.md": b"# x\n"})
    r = cli(env, "plan", "--model", "acme/config-only", "-H", "rtx-4090", "--json")
    assert r.returncode == 0, r.stderr
    assert ("planned from config.json only: the safetensors headers of acme/config-only were not read "
            "(acme/config-only has no safetensors files on the hub)") in r.stderr


# ------------------------------------------------------------------ 7. layer indices in range are taken
def test_layer_index_lists_in_range_change_the_layers(capsys, tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)
    for config, moe_layers in (({**TINY_QWEN3_MOE, "mlp_only_layers": [1]}, 1),
                               ({**TINY_LLAMA4_TEXT, "moe_layers": [0, 1]}, 2)):
        code, out, err = run_cli(capsys, "inspect", "--model", model_dir(tmp_path, config), "--json")
        assert code == 0, err
        assert json.loads(out)["moe"]["moe_layers"] == moe_layers
