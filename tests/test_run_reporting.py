"""What `run` reports and shows while it works: the headline decode rate (tokens over wall time, first token to
last) beside the per-step rates, a progress bar for long work (only at a terminal, never with --json or a pipe),
and no transformers deprecation warning on stderr."""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramplan import render  # noqa: E402
from cli_helpers import isolate  # noqa: E402
from conftest import run_profile  # noqa: E402
from vramplan.planner.profiles import resolve_profile  # noqa: E402
from vramplan.planner.request import Request  # noqa: E402
from vramplan.planner.search import plan  # noqa: E402
from vramplan.planner.sources import load_spec, resolve_model  # noqa: E402
from vramplan.runtime.execute import RunReport, execute  # noqa: E402
from vramplan.runtime.generate import EDGE_FRACTION  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HW = run_profile()  # a CPU-only profile within this machine: plans run on this machine's CPU whatever it is
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=512)
# The same CPU at 1 MFLOPS: the plan predicts a 14 s prefill of 48 tokens for the tiny model, which runs it in
# milliseconds. A long predicted prefill (the bar's condition) in a fast test.
SLOW_FLOPS = "1 MFLOPS"



@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    cfg = transformers.AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def slow_profile(tmp_path_factory) -> Path:
    d = yaml.safe_load(Path(HW).read_text())
    d["name"], d["host"]["cpu_bf16_compute"] = "slow-cpu", SLOW_FLOPS
    path = tmp_path_factory.mktemp("profiles") / "slow-cpu.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


class Recorder:
    """A Track that records what the runtime reports: (description, total, predicted_s, [advances])."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float | None, list[int]]] = []

    def __call__(self, description, total, predicted_s=None):
        from contextlib import contextmanager

        steps: list[int] = []
        self.calls.append((description, total, predicted_s, steps))

        @contextmanager
        def cm():
            yield steps.append

        return cm()


def run_here(model_dir, *, hw=HW, prompt_tokens=40, new_tokens=12, dummy_weights=False, on_text=None, track=None,
             **req) -> RunReport:
    source = resolve_model(str(model_dir))
    spec = load_spec(source)
    profile = resolve_profile(str(hw))[0]
    p = plan(spec, profile, Request(context=256, quant=("bf16",), kv_dtype=("bf16",), **req))
    assert p.fits, p.reasons
    return execute(p, spec, profile, source, dummy_weights=dummy_weights, prompt_text=None,
                   prompt_tokens=prompt_tokens, max_new_tokens=new_tokens, on_text=on_text, track=track)


# ---------------------------------------------------------------- item 1: the headline decode rate
def test_headline_decode_rate_is_tokens_over_wall_time_first_to_last(tiny_dir):
    """Two slow gaps between tokens (the text streaming slowly) dominate the wall time. The headline counts them, as
    the person waiting does; the median step does not. Before, the headline was the median step's rate."""
    gap_s, seen = 0.2, []

    def slow_terminal(piece: str) -> None:
        seen.append(piece)
        if len(seen) in (2, 3):
            time.sleep(gap_s)

    r = run_here(tiny_dir, prefill_chunk=16, on_text=slow_terminal)
    m, d = r.measured, r.to_dict()
    stamps = m.token_timestamps_s
    assert len(stamps) == m.generated_tokens == 12 and stamps[0] == m.ttft_s
    assert all(b > a for a, b in zip(stamps, stamps[1:]))
    assert m.decode_tokens_per_s == pytest.approx((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    assert m.decode_tokens_per_s < (len(stamps) - 1) / (2 * gap_s)  # the gaps are in it
    assert m.decode_tokens_per_s_median > m.decode_tokens_per_s  # a step is fast; the gaps are not steps
    # the start and end rates, over the named window
    edge = math.ceil(EDGE_FRACTION * 11)
    assert m.decode_edge_steps == edge == 2
    assert m.decode_tokens_per_s_start > 0 and m.decode_tokens_per_s_end > 0
    # the JSON: the old keys, the new ones, and the comparison made with the headline
    for key in ("decode_tokens_per_s", "decode_tokens_per_s_median", "decode_tokens_per_s_start",
                "decode_tokens_per_s_end", "decode_edge_steps", "token_timestamps_s"):
        assert d["measured"][key] is not None, key
    pred = r.predicted.decode_tokens_per_s
    assert d["error_pct"]["decode_tokens_per_s"] == pytest.approx(100 * (m.decode_tokens_per_s - pred) / pred)
    assert RunReport.from_dict(json.loads(json.dumps(d))).to_dict() == d


def test_the_table_shows_the_headline_and_the_step_rates_with_their_windows(tiny_dir, capsys):
    r = run_here(tiny_dir, prefill_chunk=16)
    render.run_report(r.to_dict())
    err = capsys.readouterr().err
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in err.splitlines() if line.count("│") >= 4}
    assert rows["decode_tokens_per_s"] == f"{r.measured.decode_tokens_per_s:.2f}"
    assert rows["decode_tokens_per_s_median (median step)"] == f"{r.measured.decode_tokens_per_s_median:.2f}"
    assert rows["decode_tokens_per_s_start (first 2 of 11 steps)"] == f"{r.measured.decode_tokens_per_s_start:.2f}"
    assert rows["decode_tokens_per_s_end (last 2 of 11 steps)"] == f"{r.measured.decode_tokens_per_s_end:.2f}"


# ---------------------------------------------------------------- item 2: progress
def test_the_prefill_advances_per_chunk_toward_the_predicted_ttft(tiny_dir):
    track = Recorder()
    r = run_here(tiny_dir, prompt_tokens=40, prefill_chunk=16, track=track)
    prefill = [c for c in track.calls if c[0] == "prefill"]
    assert len(prefill) == 1
    _, total, predicted_s, steps = prefill[0]
    assert total == 40 and steps == [16, 16, 8]  # one advance per chunk
    assert predicted_s == pytest.approx(r.predicted.ttft_s) and predicted_s > 0


def test_a_dummy_build_advances_per_layer(tiny_dir):
    track = Recorder()
    run_here(tiny_dir, new_tokens=2, dummy_weights=True, track=track)
    (description, total, predicted_s, steps), = [c for c in track.calls if c[0] != "prefill"]
    assert description.startswith("building") and total == 2 and steps == [1, 1] and predicted_s is None


def _terminal_output() -> render.Output:
    o = render.Output()
    o.err = render.Console(file=io.StringIO(), force_terminal=True, width=120)
    o.set_mode()
    return o


def test_the_bar_shows_only_for_long_work_and_never_with_json(monkeypatch):
    o = _terminal_output()
    assert o.show_progress
    with o.progress("prefill", 3, predicted_s=render.PROGRESS_MIN_S / 10) as advance:  # short: no bar
        for _ in range(3):
            advance(1)
    assert o.err.file.getvalue() == ""
    with o.progress("prefill", 3, predicted_s=10 * render.PROGRESS_MIN_S) as advance:  # long: a bar, ETA predicted
        advance(1)
        advance(2)
    shown = o.err.file.getvalue()
    assert "prefill" in shown and "3/3" in shown and "predicted 0:20" in shown
    o.set_mode(json=True)
    o.err.file = io.StringIO()
    with o.progress("prefill", 3, predicted_s=10 * render.PROGRESS_MIN_S) as advance:
        advance(3)
    assert not o.show_progress and o.err.file.getvalue() == ""


def test_work_without_a_prediction_gets_its_bar_once_it_has_taken_long(monkeypatch):
    monkeypatch.setattr(render, "PROGRESS_MIN_S", 0.05)
    o = _terminal_output()
    with o.progress("building", 3) as advance:
        advance(1)
        assert o.err.file.getvalue() == ""  # quick so far
        time.sleep(0.06)
        advance(1)
        advance(1)
    assert "building" in o.err.file.getvalue() and "3/3" in o.err.file.getvalue()


def run_cli(*args):
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def slow_run_args(tiny_dir, slow_profile, *extra):
    return ("run", "--model", str(tiny_dir), "-H", str(slow_profile), "-c", "128", "--prompt-tokens", "48",
            "--prefill-chunk", "16", "--quant", "bf16", "--max-new-tokens", "4", *extra)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves, line erases


PREFILL_LINE = ("prefill 48 tokens in chunks of 16, then up to 4 new tokens; they print as token ids: the model has no "
                "tokenizer")


def _prefill_lines(text: str) -> list[str]:
    """The lines (and redrawn bar states) that start with "prefill", without terminal escapes."""
    text = ANSI.sub("", text).replace("\r", "\n")
    return [line.strip() for line in text.splitlines() if line.startswith("prefill")]


def test_piped_output_has_no_bar_and_no_future_warning(tiny_dir, slow_profile):
    """A predicted 14 s prefill, output piped: the lines are the ones `run` always printed, nothing drawn; and no
    FutureWarning (transformers 5.24 warned on `past_key_values` every run)."""
    r = run_cli(*slow_run_args(tiny_dir, slow_profile))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FutureWarning" not in r.stderr and "deprecated" not in r.stderr, r.stderr
    assert _prefill_lines(r.stderr) == [PREFILL_LINE], r.stderr
    assert "ETA" not in r.stderr and "elapsed" not in r.stderr and "predicted vs measured" in r.stderr
    assert len(r.stdout.split()) == 4  # the four token ids, nothing else


def run_in_terminal(args: tuple[str, ...], timeout_s: float = 300) -> tuple[int, str]:
    """Run the CLI with stdin/stdout/stderr on a pseudo-terminal (140 columns); its exit code and everything shown."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "cli.py", *args], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
                            env=env, close_fds=True)
    os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
                break  # silent past the deadline: a hung child fails the test, it does not hang the suite
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), shown.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_a_terminal_shows_the_prefill_bar_with_the_predicted_eta(tiny_dir, slow_profile):
    code, shown = run_in_terminal(slow_run_args(tiny_dir, slow_profile))
    assert code == 0, shown[-2000:]
    bars = [line for line in _prefill_lines(shown) if "━" in line]
    assert bars, shown[-2000:]
    assert "predicted 0:14" in bars[0] and "ETA" in bars[0]  # the plan's 14 s TTFT
    assert any("48/48" in b for b in bars)  # it advanced to the end
    assert "FutureWarning" not in shown
    code, shown = run_in_terminal(slow_run_args(tiny_dir, slow_profile, "--json"))
    assert code == 0 and "ETA" not in shown  # --json: no bar, even at a terminal
    assert _prefill_lines(shown) == [PREFILL_LINE]
    assert json.loads(shown[shown.index("{"):])["measured"]["generated_tokens"] == 4


def test_peak_ram_over_the_plan_only_by_mapped_file_pages_is_said(tmp_path):
    """A checkpoint read through mmap puts its pages in RSS; the sampler splits them out (psutil's `shared`) and the
    report says when they alone put the peak over the plan."""
    import mmap

    from vramplan.runtime.execute import mapped_pages_note
    from vramplan.runtime.measure import PeakMemorySampler

    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\1" * (96 << 20))
    with PeakMemorySampler() as sampler, open(blob, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == len(m) // 4096  # every page read: mapped into RSS
        import time

        time.sleep(0.3)
    peaks = sampler.result
    if peaks.peak_rss_file_bytes is None:
        pytest.skip("psutil reports no shared RSS here")
    assert peaks.peak_rss_file_bytes >= 90 << 20
    anonymous = peaks.peak_rss_bytes - peaks.peak_rss_file_bytes
    peak, mapped = peaks.peak_rss_bytes, peaks.peak_rss_file_bytes
    note = mapped_pages_note(anonymous + (10 << 20), peak, mapped)
    assert "mapped from files" in note and "is within the plan's" in note
    assert "also over" in mapped_pages_note(anonymous - (10 << 20), peak, mapped)
    assert mapped_pages_note(peak, peak, mapped) is None  # not over the plan: nothing to say
    assert mapped_pages_note(0, peak, None) is None  # not measured: nothing to say
