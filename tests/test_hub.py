"""Any model from the hub without its weights: config.json and safetensors headers, against a hub on loopback.

The fake hub (tests/fake_hub.py) serves the endpoints huggingface_hub 2.4 calls and logs every request; the
CLI runs in a subprocess with HF_ENDPOINT pointing at it and HF_HOME / VRAMPLAN_CACHE_DIR in a tmp dir.
No test touches the real network.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_hub import (TINY_LLAMA, FakeHub, cli, exact_bytes, hub_env, inspect, llama_files, one_line_error,
                      safetensors_bytes)
from vramplan.planner.architectures import spec_from_config

ROOT = Path(__file__).resolve().parents[1]
# A model_type without a hand-written builder: counted from its headers alone (names as transformers saves them).
TINY_NEOX = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
             "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
             "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


@pytest.fixture
def env(tmp_path, hub):
    return hub_env(tmp_path, hub)


# ------------------------------------------------------------------ found
def test_a_hub_model_plans_in_one_command_with_exact_bytes(hub, env, tmp_path):
    files, _ = llama_files()
    repo = hub.add("acme/tiny-llama", files)
    r = cli(env, "plan", "--model", "acme/tiny-llama", "--context", "32k", "-H", "rtx-4090", "--json")
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert model["id"] == "acme/tiny-llama"
    assert model["source"].startswith(f"Hugging Face hub {hub.url}/acme/tiny-llama")
    assert model["inventory"] == "hand-written (planner/architectures)"
    # exactly these requests, in this order: model info, two range reads of the header, then config.json into the
    # cache (last: a failed header read leaves no config.json for the next call to plan from alone)
    assert [(q.method, q.path, q.range) for q in hub.log] == [
        ("GET", "/api/models/acme/tiny-llama", None),
        ("GET", f"/acme/tiny-llama/resolve/{repo.sha}/model.safetensors", "bytes=0-7"),
        ("GET", f"/acme/tiny-llama/resolve/{repo.sha}/model.safetensors", f"bytes=8-{7 + _header_len(files)}"),
        ("HEAD", "/acme/tiny-llama/resolve/main/config.json", None),
        ("GET", "/acme/tiny-llama/resolve/main/config.json", None),
    ]
    # what was fetched is in the normal HF cache and vramplan's header cache
    snap = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "snapshots" / repo.sha
    assert json.loads((snap / "config.json").read_text()) == TINY_LLAMA
    assert (tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "refs" / "main").read_text() == repo.sha
    assert (tmp_path / "vramplan" / "hub" / "models--acme--tiny-llama" / f"{repo.sha}.json").is_file()
    # the next call finds it in the HF cache, asks the hub nothing, and is as exact
    asked = len(hub.log)
    facts = inspect(env, "acme/tiny-llama")
    assert len(hub.log) == asked
    assert facts["source"].startswith("Hugging Face cache") and "safetensors headers cached" in facts["source"]
    assert facts["weight_bytes"]["checkpoint"] == exact_bytes()
    assert facts["checkpoint_dtype"] == "bfloat16"


def _header_len(files: dict[str, bytes], name: str = "model.safetensors") -> int:
    return int.from_bytes(files[name][:8], "little")


def test_only_header_bytes_are_ever_asked_for(hub, env):
    files, header_lengths = llama_files(shards=2)
    hub.add("acme/tiny-llama", files)
    inspect(env, "acme/tiny-llama")
    for name, n in header_lengths.items():
        reads = hub.requests(file=name)
        assert reads and all(q.method == "GET" and q.range for q in reads)  # never a whole-file GET, not even a HEAD
        ends = [int(q.range.rsplit("-", 1)[1]) for q in reads]
        assert max(ends) == 8 + n - 1 < len(files[name]) - 1  # the last header byte, never a data byte
        assert sum(q.body_bytes for q in reads) == 8 + n


def test_sharded_repo_reads_the_index_and_every_shard(hub, env, tmp_path):
    files, header_lengths = llama_files(shards=2)
    repo = hub.add("acme/tiny-llama", files)
    facts = inspect(env, "acme/tiny-llama")
    assert facts["weight_bytes"]["checkpoint"] == exact_bytes()
    assert facts["num_tensors"] == len(spec_from_config(TINY_LLAMA, name="t").tensors)
    assert {q.path.rsplit("/", 1)[1] for q in hub.requests(method="GET") if q.range} == set(header_lengths)
    snap = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "snapshots" / repo.sha
    assert (snap / "model.safetensors.index.json").is_file()
    assert not list(snap.glob("*.safetensors"))  # no weights in the cache
    again = inspect(env, "acme/tiny-llama", HF_HUB_OFFLINE="1")  # the index alone is not a broken checkpoint
    assert again["weight_bytes"]["checkpoint"] == exact_bytes()


def test_a_model_type_without_a_builder_is_counted_from_its_hub_headers(hub, env):
    tensors = {"gpt_neox.embed_in.weight": ("BF16", (128, 64)), "gpt_neox.final_layer_norm.weight": ("BF16", (64,)),
               "gpt_neox.final_layer_norm.bias": ("BF16", (64,)), "embed_out.weight": ("BF16", (128, 64))}
    for i in range(2):
        p = f"gpt_neox.layers.{i}"
        tensors.update({f"{p}.input_layernorm.weight": ("BF16", (64,)), f"{p}.input_layernorm.bias": ("BF16", (64,)),
                        f"{p}.post_attention_layernorm.weight": ("BF16", (64,)),
                        f"{p}.post_attention_layernorm.bias": ("BF16", (64,)),
                        f"{p}.attention.query_key_value.weight": ("BF16", (192, 64)),
                        f"{p}.attention.query_key_value.bias": ("BF16", (192,)),
                        f"{p}.attention.dense.weight": ("BF16", (64, 64)), f"{p}.attention.dense.bias": ("BF16", (64,)),
                        f"{p}.mlp.dense_h_to_4h.weight": ("BF16", (256, 64)),
                        f"{p}.mlp.dense_h_to_4h.bias": ("BF16", (256,)),
                        f"{p}.mlp.dense_4h_to_h.weight": ("BF16", (64, 256)),
                        f"{p}.mlp.dense_4h_to_h.bias": ("BF16", (64,))})
    data, _ = safetensors_bytes(tensors)
    hub.add("acme/tiny-neox", {"config.json": json.dumps(TINY_NEOX).encode(), "model.safetensors": data})
    facts = inspect(env, "acme/tiny-neox")
    numel = {n: _prod(shape) for n, (_, shape) in tensors.items()}
    assert facts["inventory"] == "safetensors headers"
    assert facts["params_total"] == sum(numel.values())
    assert facts["weight_bytes"]["checkpoint"] == 2 * sum(numel.values())
    assert facts["params_by_role"]["lm_head"] == 128 * 64 and facts["params_by_role"]["embedding"] == 128 * 64
    assert facts["params_by_role"]["attention"] == 2 * (192 * 64 + 192 + 64 * 64 + 64)
    assert facts["kv_bytes_per_token"] == 2 * 2 * 64 * 2  # 2 layers x K and V x 4 heads x 16 x bf16
    assert any("no hand-written builder" in n for n in facts["notes"])


def _prod(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def test_revision_is_asked_for_by_name(hub, env):
    files, _ = llama_files()
    repo = hub.add("acme/tiny-llama", files, refs={"v1.0": "f" * 40})
    repo.refs["v1.0"] = repo.sha
    facts = inspect(env, "acme/tiny-llama", "--revision", "v1.0")
    assert facts["weight_bytes"]["checkpoint"] == exact_bytes()
    assert hub.log[0].path == "/api/models/acme/tiny-llama/revision/v1.0"
    assert hub.requests(method="HEAD")[0].path == "/acme/tiny-llama/resolve/v1.0/config.json"
    err = one_line_error(cli(env, "inspect", "--model", "acme/tiny-llama", "--revision", "nope"))
    assert "has no revision 'nope'" in err
    # offline, the revision is found in the cache by its ref
    assert inspect(env, "acme/tiny-llama", "--revision", "v1.0", HF_HUB_OFFLINE="1")["weight_bytes"]["checkpoint"] \
        == exact_bytes()


def test_run_takes_a_hub_model_with_dummy_weights(hub, env):
    pytest.importorskip("torch")
    files, _ = llama_files()
    hub.add("acme/tiny-llama", files)
    # no --hardware: a run plans for this machine (its quick probe), and refuses a profile of a bigger one
    args = ["run", "--model", "acme/tiny-llama", "--prompt-tokens", "8", "-n", "2"]
    err = one_line_error(cli(env, *args))
    assert "has no weights here" in err and "--dummy-weights" in err
    r = cli(env, *args, "--dummy-weights", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["measured"]["generated_tokens"] == 2


# ------------------------------------------------------------------ errors, one line each
def test_not_found(hub, env):
    err = one_line_error(cli(env, "plan", "--model", "acme/no-such-model", "-H", "rtx-4090"))
    assert "no model 'acme/no-such-model'" in err and "not in the catalog" in err and "no such repo on the hub" in err
    assert "HF_TOKEN" in err
    asked = len(hub.log)
    err = one_line_error(cli(env, "inspect", "--model", "meta-llama/llama-3.1"))
    assert "ambiguous" in err and len(hub.log) == asked  # a catalog ambiguity is not a hub question


def test_gated_says_how_to_get_access(hub, env):
    files, _ = llama_files()
    hub.add("acme/gated", files, gated=True, tokens=("hf_granted",))
    err = one_line_error(cli(env, "inspect", "--model", "acme/gated"))
    assert "is gated" in err and "request access" in err and "HF_TOKEN" in err and "no token was found" in err
    assert hub.log[-1].auth is None and hub.log[-1].status == 401  # the first file asked for: a header's range read
    err = one_line_error(cli(env, "inspect", "--model", "acme/gated", HF_TOKEN="hf_other"))
    assert "is gated" in err and "has no access" in err
    assert hub.log[-1].auth == "Bearer hf_other" and hub.log[-1].status == 403  # HF_TOKEN is what was sent
    assert inspect(env, "acme/gated", HF_TOKEN="hf_granted")["weight_bytes"]["checkpoint"] == exact_bytes()


def test_offline_reads_the_cache_after_a_first_fetch(hub, env):
    files, _ = llama_files()
    hub.add("acme/tiny-llama", files)
    err = one_line_error(cli(env, "inspect", "--model", "acme/tiny-llama", HF_HUB_OFFLINE="1"))
    assert "offline mode (HF_HUB_OFFLINE=1)" in err and "not in it" in err
    assert not hub.log  # offline asks nothing
    online = inspect(env, "acme/tiny-llama")
    asked = len(hub.log)
    r = cli(env, "plan", "--model", "acme/tiny-llama", "--context", "32k", "-H", "rtx-4090", "--json",
            HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert len(hub.log) == asked
    offline = inspect(env, "acme/tiny-llama", HF_HUB_OFFLINE="1")
    assert offline["weight_bytes"] == online["weight_bytes"] and offline["params_total"] == online["params_total"]


def test_no_network_is_said_fast(env):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli(env, "inspect", "--model", "acme/tiny-llama", HF_ENDPOINT=f"http://127.0.0.1:{port}")
    err = one_line_error(r)
    assert "cannot reach the Hugging Face hub" in err and "HF_HUB_OFFLINE=1" in err
    assert r.elapsed < 5.0


def test_a_hub_that_never_answers_times_out_in_under_10_s(env):
    """A listening socket that never answers (a black hole): the configured timeout, not huggingface_hub's none."""
    from vramplan.runtime.hub import HUB_TIMEOUT_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        r = cli(env, "inspect", "--model", "acme/tiny-llama", HF_ENDPOINT=f"http://127.0.0.1:{s.getsockname()[1]}")
    err = one_line_error(r)
    assert "cannot reach the Hugging Face hub" in err and "Timeout" in err
    assert HUB_TIMEOUT_S <= r.elapsed < 10.0


@pytest.mark.parametrize("weights,kind", [({"model-q4_k_m.gguf": b"GGUF" + bytes(60)}, "GGUF"),
                                          ({"pytorch_model.bin": bytes(64), "config.json": b"{}"}, "pickle")])
def test_repos_without_safetensors_are_refused(hub, env, weights, kind):
    hub.add("acme/other-format", {"README.md": b"# x\n", **weights})
    err = one_line_error(cli(env, "inspect", "--model", "acme/other-format"))
    assert f"has only {kind}" in err and "no safetensors" in err
    assert not any(q.path.endswith((".gguf", ".bin")) for q in hub.log)  # not even a header of those


def test_malformed_header_is_one_line(hub, env):
    bad = (30).to_bytes(8, "little") + b"{this is not json, truncated" + bytes(100)
    hub.add("acme/broken", {"config.json": json.dumps(TINY_LLAMA).encode(), "model.safetensors": bad})
    err = one_line_error(cli(env, "inspect", "--model", "acme/broken"))
    assert "corrupt safetensors header" in err and "acme/broken/model.safetensors" in err
    huge = (10**12).to_bytes(8, "little") + bytes(100)
    hub.add("acme/huge", {"config.json": json.dumps(TINY_LLAMA).encode(), "model.safetensors": huge})
    err = one_line_error(cli(env, "inspect", "--model", "acme/huge"))
    assert "declared length" in err
    assert [q.range for q in hub.log if q.path.startswith("/acme/huge/") and q.path.endswith(".safetensors")] == \
        ["bytes=0-7"]  # a declared length beyond the file is not read


# ------------------------------------------------------------------ a server that ignores Range
def test_a_server_that_ignores_range_still_sends_no_weights(hub):
    """A 200 with the whole file instead of a 206: the client takes the header's bytes and hangs up."""
    from vramplan.runtime.hub import remote_header

    tensors = {"w": ("BF16", (4096, 2560))}  # 20 MiB of data behind a short header
    data, n = safetensors_bytes(tensors)
    repo = hub.add("acme/plain", {"model.safetensors": data}, ignore_range=True)
    header = remote_header("acme/plain", repo.sha, "model.safetensors", hub.url)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in header] == [("w", "bfloat16", (4096, 2560), 4096 * 2560 * 2)]
    reads = hub.requests(file="model.safetensors")
    assert [q.range for q in reads] == ["bytes=0-7", f"bytes=8-{7 + n}"] and all(q.status == 200 for q in reads)
    deadline = time.monotonic() + 10
    while not all(q.aborted for q in reads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(q.aborted for q in reads)  # the 20 MiB were never taken


# ------------------------------------------------------------------ no torch, and fast
PLANNER_ONLY = """
import sys, time
sys.modules['torch'] = None; sys.modules['transformers'] = None  # the planner-only install: neither importable
t0 = time.perf_counter()
from vramplan import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(f"RC={code} S={time.perf_counter() - t0:.3f}", file=sys.stderr)
"""


def planner_only(env, *args):
    return subprocess.run([sys.executable, "-c", PLANNER_ONLY, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_the_planner_only_install_plans_hub_models(hub, env):
    """Without torch and transformers: a hub model (cold and warm cache), one without a hand-written builder
    (its headers), and a one-line error for a config-only model that would need the meta device."""
    files, _ = llama_files()
    hub.add("acme/tiny-llama", files)
    args = ["plan", "--model", "acme/tiny-llama", "--context", "32k", "-H", "rtx-4090", "--json"]
    for cache in ("cold", "warm"):
        r = planner_only(env, *args)
        assert "RC=0" in r.stderr, (cache, r.stderr)
    layers = {f"gpt_neox.layers.{i}.attention.dense.weight": ("BF16", (64, 64)) for i in range(2)}
    data, _ = safetensors_bytes({"gpt_neox.embed_in.weight": ("BF16", (128, 64)), **layers})
    hub.add("acme/neox", {"config.json": json.dumps(TINY_NEOX).encode(), "model.safetensors": data})
    r = planner_only(env, "inspect", "--model", "acme/neox", "--json")
    assert "RC=0" in r.stderr and json.loads(r.stdout)["inventory"] == "safetensors headers", r.stderr
    hub.add("acme/neox-config", {"config.json": json.dumps(TINY_NEOX).encode()})
    r = planner_only(env, "inspect", "--model", "acme/neox-config")
    assert "RC=2" in r.stderr and "unsupported architecture model_type='gpt_neox'" in r.stderr
    assert "pip install 'vramplan[runtime]'" in r.stderr and "Traceback" not in r.stderr
