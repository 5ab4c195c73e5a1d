"""`moeserve serve` started and stopped as a service would be (a real process on the tiny model, CPU).

SIGTERM (systemd, docker stop, Kubernetes) and SIGINT (Ctrl-C) let requests in flight finish (or abort them after
--shutdown-timeout), stop the engine core and exit 0 with no ERROR line and no process left behind, zombie or alive.
Command-line mistakes get one `error:` line and no traceback, and a port in use is reported before the model loads.
Processes the server leaves behind are caught by making this process a child subreaper (Linux): an orphan of the
server becomes a child of the test instead of PID 1's.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
PR_SET_CHILD_SUBREAPER = 36
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper and /proc: Linux")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from moeserve.models.tiny import make_tiny

    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("lifecycle_tiny"))


def _children() -> dict[int, str]:
    """pid -> state of every process whose parent is this one."""
    me, found = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me:
            found[int(entry)] = state
    return found


@pytest.fixture
def leftovers():
    """A function returning the processes (pid -> state) left behind by servers started since the fixture began;
    they are killed and reaped at the end."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("cannot become a child subreaper")
    before = set(_children())
    started: list[subprocess.Popen] = []

    def left() -> dict[int, str]:
        mine = {p.pid for p in started}
        return {pid: st for pid, st in _children().items() if pid not in before and pid not in mine}

    left.started = started
    try:
        yield left
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
        for pid in left():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(leftovers, model_dir, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(model_dir), "--port", str(port), "--device",
           "cpu", "--served-model-name", "tiny", "--max-model-len", "512", *extra]
    with open(log, "w") as f:  # its own session: a signal to its process group reaches the core too, as Ctrl-C does
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    leftovers.started.append(proc)
    deadline = time.monotonic() + 120
    while "serving model" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def _core_pid(log: Path) -> int:
    line = next(line for line in log.read_text().splitlines() if "engine core pid" in line)
    return int(line.split("engine core pid ")[1].split(",")[0])


@pytest.mark.parametrize("sig,group,shutdown_timeout,finish", [
    # docker stop / Kubernetes: the frontend alone; drained
    pytest.param(signal.SIGTERM, False, "60", "length", id="sigterm-frontend"),
    # systemd: every process of the service at once; drained
    pytest.param(signal.SIGTERM, True, "60", "length", id="sigterm-group"),
    # Ctrl-C reaches the process group; no drain time: aborted
    pytest.param(signal.SIGINT, True, "0", "abort", id="sigint-group-no-drain"),
    # systemd with a tensor-parallel worker in the group too
    pytest.param(signal.SIGTERM, True, "60", "length", id="sigterm-group-tp2"),
])
def test_stop_signal_finishes_or_aborts_requests_and_exits_0(model_dir, tmp_path, leftovers, sig, group,
                                                             shutdown_timeout, finish, request):
    log = tmp_path / "server.log"
    tp = ["--tensor-parallel-size", "2"] if request.node.callspec.id.endswith("tp2") else []
    proc, url = _start_server(leftovers, model_dir, log, "--shutdown-timeout", shutdown_timeout, *tp)
    core = _core_pid(log)
    # long enough to be running when the signal comes, short enough to drain well inside the drain time on a
    # busy 2-core machine (400 tokens at TP=2 once took longer than 30 s there)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    if not group:  # the server as a client first sees it: where it says it listens, its model under the served
        # name, a completion
        assert f"at {url}/v1" in log.read_text(), log.read_text()
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny"]
        done = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
                          timeout=60).json()
        assert done["usage"]["completion_tokens"] >= 1, done
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the request is running
        (os.killpg if group else os.kill)(proc.pid, sig)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert proc.wait(90) == 0, log.read_text()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert reasons[-1] == finish
    if finish == "length":
        assert chunks[-1]["usage"]["completion_tokens"] == 120
    text = log.read_text()
    assert "ERROR" not in text and "Traceback" not in text, text
    assert not leftovers(), (leftovers(), text)
    assert not os.path.exists(f"/proc/{core}")  # reaped by the frontend, not left to whoever adopts it


def _serve_fails(leftovers, *args: str) -> str:
    """Output of a `moeserve serve` that must refuse to start: nonzero exit, one `error:` line, no traceback and no
    process left."""
    proc = subprocess.Popen([sys.executable, "-m", "moeserve", "serve", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    leftovers.started.append(proc)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out and "ERROR" not in out, out
    assert not leftovers(), out
    return errors[0]


def test_port_in_use_is_one_line_found_before_the_model_loads(leftovers, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model does not exist either: the port is checked first, so that is the error reported
        err = _serve_fails(leftovers, "--model", str(tmp_path / "nonexistent"), "--port", str(port))
    assert f"127.0.0.1:{port}" in err and "in use" in err and "--port" in err, err


# One case per kind of mistake the engine core raises at start. A folder without config.json is a FileNotFoundError
# from the core's start as a missing folder is (the same lines carry it): its message is checked in process below.
@pytest.mark.parametrize("case", ["nonexistent", "bad_adapter", "block_size"])
def test_mistakes_the_engine_finds_are_one_error_line(model_dir, tmp_path, leftovers, case):
    args, want = {
        "nonexistent": (["--model", str(tmp_path / "nope")], "does not exist"),
        "bad_adapter": (["--model", str(model_dir), "--lora-modules", f"a={tmp_path / 'nope'}"], "LoRA adapter 'a'"),
        "block_size": (["--model", str(model_dir), "--block-size", "12"], "--block-size"),
    }[case]
    err = _serve_fails(leftovers, *args, "--port", str(_free_port()))
    assert want in err, err


def test_a_model_folder_without_config_json_is_named(tmp_path):
    from moeserve import Engine, EngineConfig

    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(EngineConfig(model=str(tmp_path), device="cpu"))


@pytest.mark.parametrize("args,want", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--port", "70000"], "cannot listen on 127.0.0.1:70000 (--host, --port)"),
    (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:8000 (--host, --port): unknown host"),
    (["--timeout-header", "0"], "timeout_header (--timeout-header) must be a positive number"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_bad_flag_values_are_one_error_line(capsys, args, want):
    """Found before anything is bound or loaded (in this process: no engine is started)."""
    from moeserve import cli

    try:
        rc = cli.main(["serve", "--model", "/nonexistent", *args])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and not out, (out, err)
    assert err.splitlines() == [err.strip()] and err.startswith("error: ") and want in err, err


FORGOTTEN_CLIENT = """
import asyncio, sys, threading
from moeserve import EngineConfig
from moeserve.frontend.core_client import EngineClient
if __name__ == "__main__":
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    start = EngineClient.start(EngineConfig(model=sys.argv[1], device="cpu"), "WARNING")
    client = asyncio.run_coroutine_threadsafe(start, loop).result(120)
    print("core", client.proc.pid, flush=True)
"""


def test_a_client_never_shut_down_does_not_hang_the_exit(model_dir, tmp_path, leftovers):
    """The serving core ignores SIGTERM (the frontend stops it after draining), which multiprocessing would stop it
    with at the interpreter's exit before waiting for it without end; the client kills it first."""
    script = tmp_path / "forgotten.py"
    script.write_text(FORGOTTEN_CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)
    leftovers.started.append(proc)
    out = proc.communicate(timeout=120)[0]  # hung before the fix
    assert proc.returncode == 0 and "core " in out and "ERROR" not in out, out
    core = int(out.split("core ")[1].split()[0])
    assert core not in leftovers() and not os.path.exists(f"/proc/{core}")  # killed and reaped


def test_stop_signal_while_the_engine_starts_abandons_the_start(model_dir, tmp_path, leftovers):
    """systemd stopping the service while the model loads: the start is abandoned (the core and its tensor-parallel
    worker stop), exit 0, nothing left. The signal is sent once the core's worker runs, long before the core is
    ready: its ranks still have to meet and load their shards."""
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(model_dir), "--port", str(_free_port()),
           "--device", "cpu", "--tensor-parallel-size", "2"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    leftovers.started.append(proc)
    deadline = time.monotonic() + 120

    def children(pid) -> list[str]:
        try:
            return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:  # gone meanwhile
            return []

    def grandchildren() -> list[str]:
        return [g for k in children(proc.pid) for g in children(k)]

    while not grandchildren():  # the core's worker
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()
    text = log.read_text()
    assert "stopped while the engine was starting" in text and "serving model" not in text, text
    assert "ERROR" not in text and "Traceback" not in text, text
    assert not leftovers(), (leftovers(), text)
