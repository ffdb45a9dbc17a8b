"""Files in and out: --save writes regular files only (through a symlink, keeping the mode; never over a device, a
FIFO, a socket or the command's own input) in the format its suffix names; every file read must be a regular file
(a FIFO would hang); a plan cut short is refused; stdout that fails or closes, and SIGTERM, end cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli_helpers import assert_one_line_error, isolate, run_cli as main
from conftest import run_profile, tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3.1-8b"  # a catalog model: plans without any download
HW = "cpu-ddr5-desktop"  # a CPU-only shipped profile: a plan made with it runs on this machine's CPU
SHIPPED_HW = ROOT / "profiles" / f"{HW}.yaml"
RUN_HW = run_profile()  # what `run` takes: HW within this machine
HANG_GUARD_S = 20  # a read that blocks (a FIFO) fails the test instead of hanging the suite


def run_cli(*argv, stdout) -> subprocess.CompletedProcess:
    """The CLI in its own process with `stdout` as given (stderr captured)."""
    return subprocess.run([sys.executable, "cli.py", *map(str, argv)], cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=120)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


@pytest.fixture
def hang_guard():
    """SIGALRM after HANG_GUARD_S: a blocking open() or read() raises instead of waiting forever."""
    def fire(signum, frame):
        raise TimeoutError(f"blocked for {HANG_GUARD_S} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(HANG_GUARD_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A tiny llama's model directory: config.json only (runs with --dummy-weights)."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config_dict("llama")))
    return d


def _device(tmp_path: Path, name: str, major: int, minor: int) -> Path:
    """A character device node of our own (as root), so that a regression replaces it rather than the machine's
    /dev/null; without the right to make one, the system's (which a user who is not root cannot replace)."""
    node = tmp_path / f"{name}.yaml"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        return node
    except OSError:
        if os.access("/dev", os.W_OK):
            pytest.skip("cannot make a device node, and /dev is writable here: not risking the real one")
        return Path("/dev") / name


@pytest.fixture
def specials(tmp_path):
    """Paths that are not regular files: a FIFO, a socket, character devices (null: 1,3 and full: 1,7)."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.yaml"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    yield {"fifo": fifo, "socket": sock_path, "devnull": _device(tmp_path, "null", 1, 3),
           "devfull": _device(tmp_path, "full", 1, 7)}
    sock.close()


SPECIAL_KIND = {"fifo": stat.S_ISFIFO, "socket": stat.S_ISSOCK, "devnull": stat.S_ISCHR, "devfull": stat.S_ISCHR}
SPECIAL_WORDS = {"fifo": "is a FIFO", "socket": "is a socket", "devnull": "is a character device",
                 "devfull": "is a character device"}


# ---------------------------------------------------------------- 1. --save: regular files only
SAVE_COMMANDS = {
    "plan": ["plan", "--model", MODEL, "-H", HW, "--save", "{out}"],
    "run": ["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--prompt-tokens", "8", "-n", "2",
            "--save", "{out}"],
    "calibrate --save": ["calibrate", "-H", HW, "--models", "qwen2.5-0.5b", "--save", "{out}"],
    "calibrate --save-runs": ["calibrate", "-H", HW, "--models", "qwen2.5-0.5b", "--save-runs", "{out}"],
    "probe --save": ["probe", "--quick", "--save", "{out}"],
}


@pytest.mark.parametrize("kind", list(SPECIAL_KIND))
@pytest.mark.parametrize("command", list(SAVE_COMMANDS))
def test_save_over_a_device_fifo_or_socket_is_refused_up_front(capsys, specials, tiny, hang_guard, command, kind):
    target = specials[kind]
    argv = [a.format(out=target, tiny=tiny) for a in SAVE_COMMANDS[command]]
    code, out, err = main(capsys, *argv)
    line = assert_one_line_error(code, err)
    assert f"{target}: {SPECIAL_WORDS[kind]}" in line and "regular files only" in line, line
    assert SPECIAL_KIND[kind](os.lstat(target).st_mode), f"{target} was replaced"
    assert "loading" not in err and "probe took" not in err and not out, err  # refused before any work


def test_save_through_a_symlink_writes_its_target_and_keeps_the_link(capsys, tmp_path):
    real_dir = tmp_path / "team"
    real_dir.mkdir()
    real = real_dir / "plan.yaml"
    real.write_text("old\n")
    real.chmod(0o664)
    link = tmp_path / "plan-link.yaml"
    link.symlink_to(Path("team") / "plan.yaml")  # relative, as `ln -s` makes them
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", link)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(Path("team") / "plan.yaml")
    assert yaml.safe_load(real.read_text())["schema_version"] == 1
    assert stat.S_IMODE(real.stat().st_mode) == 0o664  # still team-readable and -writable
    assert not list(tmp_path.glob(".*.tmp")) and not list(real_dir.glob(".*.tmp"))


def test_save_through_a_dangling_symlink_creates_its_target(capsys, tmp_path):
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "made.yaml")
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", link)
    assert code == 0, err
    assert link.is_symlink() and yaml.safe_load((tmp_path / "made.yaml").read_text())["fits"] is True


@pytest.mark.parametrize("mode", [0o664, 0o640, 0o600, 0o666])
def test_a_replaced_file_keeps_its_mode(capsys, tmp_path, mode):
    path = tmp_path / "p.yaml"
    path.write_text("old\n")
    path.chmod(mode)
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", path)
    assert code == 0, err
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert "schema_version: 1" in path.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
def test_a_replaced_file_keeps_its_owner_as_root(capsys, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("old\n")
    os.chown(path, 4321, 4322)
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", path)
    assert code == 0, err
    st = path.stat()
    assert (st.st_uid, st.st_gid) == (4321, 4322) and "schema_version: 1" in path.read_text()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_a_new_file_gets_the_umask_mode_not_0600(capsys, tmp_path, umask):
    previous = os.umask(umask)
    try:
        code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", tmp_path / "new.yaml")
    finally:
        os.umask(previous)
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("argv, flag, given", [
    (["plan", "--model", MODEL, "-H", "{hw}", "--save", "{hw}"], "--hardware", "{hw}"),
    (["plan", "--model", MODEL, "-H", "{hw}", "--save", "{tmp}/sub/../hw.yaml"], "--hardware", "{tmp}/sub/../hw.yaml"),
    (["plan", "--model", MODEL, "-H", "{hw}", "--save", "{tmp}/hw-link.yaml"], "--hardware", "{tmp}/hw-link.yaml"),
    (["plan", "--model", MODEL, "-H", "{hw}", "--save", "{tmp}/hw-hardlink.yaml"], "--hardware",
     "{tmp}/hw-hardlink.yaml"),
    (["plan", "--model", "{tiny}", "-H", HW, "--save", "{tiny}/config.json"], "--model", "{tiny}/config.json"),
    (["plan", "--model", "{tiny}/config.json", "-H", HW, "--save", "{tiny}/config.json"], "--model",
     "{tiny}/config.json"),
    (["run", "--model", "{tiny}", "--dummy-weights", "--plan", "{plan}", "--save", "{plan}"], "--plan", "{plan}"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", "{hw}", "--prompt-tokens", "8", "--save", "{hw}"],
     "--hardware", "{hw}"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--prompt-file", "{prompt}", "--save", "{prompt}"],
     "--prompt-file", "{prompt}"),
    (["calibrate", "-H", "{hw}", "--save", "{hw}"], "--hardware", "{hw}"),
    (["calibrate", "-H", HW, "--add-runs", "{runs},{tmp}/other.json", "--save-runs", "{runs}"], "--add-runs",
     "{runs}"),
    (["calibrate", "-H", HW, "--save", "{tmp}/same.yaml", "--save-runs", "{tmp}/same.yaml"], "--save",
     "{tmp}/same.yaml"),
])
def test_saving_over_an_input_is_refused_before_any_work(capsys, tmp_path, tiny, argv, flag, given):
    hw = tmp_path / "hw.yaml"
    hw.write_text(SHIPPED_HW.read_text())
    (tmp_path / "sub").mkdir()
    (tmp_path / "hw-link.yaml").symlink_to(hw)
    os.link(hw, tmp_path / "hw-hardlink.yaml")
    (tmp_path / "plan.yaml").write_text("schema_version: 1\n")
    (tmp_path / "prompt.txt").write_text("hello")
    (tmp_path / "runs.json").write_text('{"runs": []}')
    names = {"hw": hw, "tmp": tmp_path, "tiny": tiny, "plan": tmp_path / "plan.yaml",
             "prompt": tmp_path / "prompt.txt", "runs": tmp_path / "runs.json"}
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = main(capsys, *[a.format(**names) for a in argv])
    line = assert_one_line_error(code, err)
    save_flag = "--save-runs" if "--save-runs" in argv else "--save"
    kind = "output" if flag == "--save" else "input"
    assert line == f"error: {save_flag} {given.format(**names)} is also the {flag} {kind}; choose another path", line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written
    assert not out


def test_an_input_named_not_given_as_a_file_is_no_conflict(capsys, tmp_path, monkeypatch):
    """-H by name reads a profile from the search path; a --save of the same name in the working directory is
    another file (only a path to the same file is refused)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", f"{HW}.yaml")
    assert code == 0, err
    assert (tmp_path / f"{HW}.yaml").is_file() and SHIPPED_HW.read_text().startswith("#")


@pytest.mark.parametrize("name, parse", [
    ("p.json", json.loads),
    ("p.JSON", json.loads),
    ("p.yaml", yaml.safe_load),
    ("p.yml", yaml.safe_load),
    ("p.plan", yaml.safe_load),  # another suffix: plan's default, YAML
])
def test_plan_save_format_follows_the_suffix(capsys, tmp_path, name, parse):
    code, _, err = main(capsys, "plan", "--model", MODEL, "-H", HW, "--save", tmp_path / name)
    assert code == 0, err
    text = (tmp_path / name).read_text()
    assert text.startswith("{") == (parse is json.loads)
    assert parse(text)["schema_version"] == 1


def test_a_plan_saved_as_json_runs_and_a_run_report_saves_as_yaml(capsys, tmp_path, tiny):
    code, _, err = main(capsys, "plan", "--model", tiny, "-H", RUN_HW, "-c", "256", "--save", tmp_path / "p.json")
    assert code == 0, err
    json.loads((tmp_path / "p.json").read_text())
    code, _, err = main(capsys, "run", "--model", tiny, "--dummy-weights", "-H", RUN_HW, "--plan", tmp_path / "p.json",
                        "--prompt-tokens", "8", "-n", "2", "--save", tmp_path / "r.yaml")
    assert code == 0, err[-2000:]
    report = (tmp_path / "r.yaml").read_text()
    assert not report.startswith("{")
    assert yaml.safe_load(report)["measured"]["generated_tokens"] == 2
    code, _, err = main(capsys, "run", "--model", tiny, "--dummy-weights", "-H", RUN_HW, "--plan", tmp_path / "p.json",
                        "--prompt-tokens", "8", "-n", "2", "--save", tmp_path / "r.out")
    assert code == 0, err[-2000:]
    assert json.loads((tmp_path / "r.out").read_text())["measured"]["generated_tokens"] == 2  # run's default: JSON


def test_a_profile_saved_as_json_reads_back(capsys, tmp_path):
    from vramplan.planner.profile_yaml import load_profile, profile_to_dict
    from vramplan.planner.profiles import resolve_profile
    from vramplan.runtime.files import save_profile

    profile = resolve_profile(HW)[0]
    save_profile(profile, tmp_path / "box.json")
    assert json.loads((tmp_path / "box.json").read_text())["name"] == profile.name
    assert profile_to_dict(load_profile(tmp_path / "box.json")) == profile_to_dict(profile)
    code, out, err = main(capsys, "profiles", "validate", tmp_path / "box.json")
    assert code == 0 and "ok:" in out, err


@pytest.mark.parametrize("name", ["runs.json", "runs.yaml", "runs.data"])
def test_saved_runs_read_back_in_the_format_their_suffix_names(tmp_path, name):
    from vramplan.planner.calibration import Sample
    from vramplan.runtime.calibrate import RunRecord, load_runs
    from vramplan.runtime.files import save_data

    sample = Sample(device="cpu", backend="torch", quant="bf16", bandwidth_bytes_per_s=5e10, peak_flops=1e12,
                    bytes_read_per_token=1e9, kv_bytes_per_token=1e6, attention_flops_per_token=1e6,
                    attention_impl="sdpa", num_layers=24, decode_s_per_token=0.05, prefill_flops=1e12,
                    prefill_chunks=1, prefill_s=0.5, prefill_attention_flops=1e9)
    record = RunRecord(model="qwen2.5-0.5b", quant="bf16", kv_dtype="bf16", prompt=64, new_tokens=8,
                       decode_tokens_per_s=20.0, ttft_s=0.5, peak_rss_bytes=10**9, sample=sample)
    save_data(tmp_path / name, {"runs": [record.to_dict()]}, default="json")
    text = (tmp_path / name).read_text()
    assert text.startswith("{") == (not name.endswith(".yaml"))
    assert load_runs((str(tmp_path / name),)) == [record]


# ---------------------------------------------------------------- 2. I/O errors, closed pipes, SIGTERM
PLAN_ARGS = ["plan", "--model", MODEL, "-H", HW]
PIPE_PAGE_BYTES = 4096  # the smallest pipe Linux makes (one page)


def test_save_where_nothing_can_be_written_is_exit_2_with_the_os_message(capsys):
    code, out, err = main(capsys, *PLAN_ARGS, "--save", "/proc/x.yaml")
    line = assert_one_line_error(code, err)
    assert line == "error: /proc/x.yaml: cannot write (No such file or directory)", line
    assert not out


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--yaml"]])
def test_stdout_on_a_full_disk_is_exit_2_in_one_line(fmt):
    with open("/dev/full", "w") as full:
        r = run_cli(*PLAN_ARGS, *fmt, stdout=full)
    line = assert_one_line_error(r.returncode, r.stderr)
    assert line == "error: cannot write to stdout (No space left on device)", r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--yaml"]])
def test_stdout_closed_by_its_reader_ends_quietly_with_0(fmt):
    """`vramplan plan | head -1`: the reader has gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = run_cli(*PLAN_ARGS, *fmt, stdout=write_end)
    finally:
        os.close(write_end)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr


def test_stdout_closed_after_the_first_line_ends_quietly_with_0():
    """`vramplan plan --json | head -1`: the pipe is made to hold one page (F_SETPIPE_SZ), so the 60 kB plan is
    still being written when the reader closes it after the first line."""
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_PAGE_BYTES)
    # a buffered stdout, as a shell gives it (under PYTHONUNBUFFERED a write to a full pipe loses the rest silently)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "cli.py", *PLAN_ARGS, "--json"], cwd=ROOT, stdout=write_end,
                            stderr=subprocess.PIPE, text=True, env=env)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        assert reader.readline().strip() == "{"
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert err == "", err


# Runs the real cli.main on a plan command; the planning step is swapped for one that sends this process the
# signal named in argv[1] and then waits, so that the signal arrives mid-command every time (no timing games).
SIGNAL_HOOK = """
import os, signal, sys, threading
sys.path.insert(0, os.getcwd())
from vramplan import cli
from vramplan.planner import engines


def planning_that_waits(*args, **kwargs):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    threading.Event().wait(60)
    raise SystemExit("the signal did not stop the command")


engines.plan_for_engine = planning_that_waits
cli.main(sys.argv[2:])
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_end_a_plan_with_130_and_interrupted(sig):
    r = subprocess.run([sys.executable, "-c", SIGNAL_HOOK, sig, *PLAN_ARGS], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "interrupted", r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_main_turns_sigterm_into_keyboard_interrupt_while_it_runs_and_restores_it(capsys, monkeypatch):
    seen = {}

    def planning_that_looks(*args, **kwargs):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        raise KeyboardInterrupt  # end the command as Ctrl-C would

    from vramplan.planner import engines

    monkeypatch.setattr(engines, "plan_for_engine", planning_that_looks)
    before = signal.getsignal(signal.SIGTERM)
    code, _, err = main(capsys, *PLAN_ARGS)
    assert code == 130 and "interrupted" in err
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt):
        seen["handler"](signal.SIGTERM, None)


# ---------------------------------------------------------------- 3. every file read must be a regular file
@pytest.mark.parametrize("argv, says", [
    (["profiles", "show", "{fifo}"], "{fifo}: is a FIFO, not a hardware profile file"),
    (["plan", "--model", MODEL, "-H", "{fifo}"], "{fifo}: is a FIFO, not a hardware profile file"),
    (["plan", "--model", MODEL, "-H", "{socket}"], "{socket}: is a socket, not a hardware profile file"),
    (["plan", "--model", MODEL, "-H", "/dev/null"], "/dev/null: is a character device, not a hardware profile file"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--plan", "{fifo}", "--prompt-tokens", "8"],
     "{fifo}: cannot read the plan (is a FIFO, not a regular file)"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--plan", "/dev/null", "--prompt-tokens", "8"],
     "/dev/null: cannot read the plan (is a character device, not a regular file)"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--prompt-file", "{fifo}"],
     "--prompt-file {fifo}: is a FIFO, not a regular file"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--prompt-file", "/dev/null"],
     "--prompt-file /dev/null: is a character device, not a regular file"),
    (["run", "--model", "{tiny}", "--dummy-weights", "-H", RUN_HW, "--prompt-file", "{tmp}"],
     "--prompt-file {tmp}: is a directory, not a regular file"),
    (["calibrate", "-H", HW, "--add-runs", "{fifo}"], "{fifo}: cannot read (is a FIFO, not a regular file)"),
])
def test_reading_a_fifo_device_or_socket_is_refused_not_a_hang(capsys, tmp_path, specials, tiny, hang_guard, argv,
                                                                says):
    names = {"fifo": specials["fifo"], "socket": specials["socket"], "tiny": tiny, "tmp": tmp_path}
    code, _, err = main(capsys, *[a.format(**names) for a in argv])
    line = assert_one_line_error(code, err)
    assert line == f"error: {says.format(**names)}", line


def test_profiles_validate_reports_a_fifo_as_invalid_without_hanging(capsys, specials, hang_guard):
    """validate's contract: one line per bad file, exit 1 when any is bad (as for a missing file)."""
    code, out, err = main(capsys, "profiles", "validate", SHIPPED_HW, specials["fifo"])
    assert code == 1 and f"ok: {SHIPPED_HW}" in out, err
    assert err.strip() == f"invalid: {specials['fifo']}: cannot read: is a FIFO, not a regular file", err


# ---------------------------------------------------------------- 4. a plan cut short, or for another model
@pytest.fixture
def saved_plan(capsys, tmp_path, tiny) -> Path:
    path = tmp_path / "plan.yaml"
    code, _, err = main(capsys, "plan", "--model", tiny, "-H", RUN_HW, "-c", "256", "--save", path)
    assert code == 0, err
    assert len(path.read_text().splitlines()) > 200
    return path


def test_a_plan_cut_to_100_lines_is_refused_before_any_model_loads(capsys, tmp_path, tiny, saved_plan):
    cut = tmp_path / "cut.yaml"
    cut.write_text("".join(saved_plan.read_text().splitlines(True)[:100]))
    code, _, err = main(capsys, "run", "--model", tiny, "--dummy-weights", "-H", RUN_HW, "--plan", cut,
                        "--prompt-tokens", "8", "-n", "2")
    line = assert_one_line_error(code, err)
    assert line.startswith(f"error: {cut}: plan file is incomplete: it has no ") and "(cut short?)" in line, line
    assert "loading" not in err


def test_a_plan_cut_at_any_line_is_refused(saved_plan, tmp_path):
    from vramplan.planner.errors import PlanError
    from vramplan.planner.plan import load_plan

    lines = saved_plan.read_text().splitlines(True)
    load_plan(saved_plan)  # the whole file loads
    step = max(1, len(lines) // 60)
    for n in [*range(1, len(lines), step), len(lines) - 1, 100]:
        cut = tmp_path / f"cut{n}.yaml"
        cut.write_text("".join(lines[:n]))
        with pytest.raises(PlanError, match="incomplete|not a vramplan plan|not valid YAML"):
            load_plan(cut)


def test_a_json_plan_cut_short_is_refused(capsys, tmp_path, tiny):
    path = tmp_path / "p.json"
    code, _, err = main(capsys, "plan", "--model", tiny, "-H", HW, "-c", "256", "--save", path)
    assert code == 0, err
    text = path.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    code, _, err = main(capsys, "run", "--model", tiny, "--dummy-weights", "-H", RUN_HW, "--plan",
                        tmp_path / "cut.json", "--prompt-tokens", "8")
    assert "not valid YAML or JSON" in assert_one_line_error(code, err)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("candidates"), "it has no candidates"),
    (lambda d: d["candidates"][-1].pop("reason"), "it has no reason in candidates[{last}] (cut short?)"),
    (lambda d: d["model"].pop("fingerprint"), "it has no fingerprint in model (cut short?)"),
    (lambda d: d["request"].pop("context"), "it has no context in request (cut short?)"),
    (lambda d: d.update(reasons="all fits"), "reasons must be list, got str"),
    (lambda d: d.update(fits=1), "fits must be bool, got int"),
    (lambda d: d.update(memory=None), "memory is empty in a plan that fits"),
])
def test_a_plan_missing_a_key_is_refused_naming_it(capsys, tmp_path, tiny, saved_plan, edit, says):
    d = yaml.safe_load(saved_plan.read_text())
    edit(d)
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(d, sort_keys=False))
    code, _, err = main(capsys, "run", "--model", tiny, "--dummy-weights", "-H", RUN_HW, "--plan", edited,
                        "--prompt-tokens", "8")
    line = assert_one_line_error(code, err)
    assert says.format(last=len(d.get("candidates", [])) - 1) in line, line


def test_a_plan_for_another_model_is_refused(capsys, tmp_path, saved_plan):
    other = tmp_path / "tiny-qwen2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(tiny_config_dict("qwen2")))
    code, _, err = main(capsys, "run", "--model", other, "--dummy-weights", "-H", RUN_HW, "--plan", saved_plan,
                        "--prompt-tokens", "8")
    line = assert_one_line_error(code, err)
    assert "the plan was made for model 'tiny-llama', not 'tiny-qwen2'" in line, line
    assert "loading" not in err
