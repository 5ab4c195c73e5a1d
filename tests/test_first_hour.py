"""The README's commands, run as a new user would run them (issue 10, item 8).

Every command in README.md's fenced bash blocks, and every python block, is either run here or listed in
NOT_RUN with the reason. Run against a stand-in for the demo model: a tiny random Mixtral under the demo
model's name in a private MOESERVE_CACHE_DIR, with `caps` and `brief` adapters trained on it by the real
training code (a few steps on canned answers), so `moeserve serve` with no --model, the curl calls and
the openai snippet run verbatim (only the port differs) in seconds. The real demo model and adapters are
checked in test_tiny_and_upcycle.py (slow) and by `moeserve demo` there.

Not automated: `bash scripts/demo.sh` / `scripts/test.sh` / `scripts/setup.sh` (a venv install of
minutes; CI runs test.sh through .ci/run, which is checked to), `moeserve demo` on the real demo model
(slow test elsewhere), `moeserve bench ...` (GPU).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moeserve import cli
from moeserve import demo_adapters as demo
from moeserve.models.tiny import make_tiny
from moeserve.models.upcycle import DEMO_MODEL_NAME

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
NOT_RUN = {  # command prefix -> why the test does not run it
    "bash scripts/demo.sh": "installs a venv and builds the real demo model (minutes)",
    "bash scripts/test.sh": "the test suite itself",
    "bash scripts/setup.sh": "installs a venv (minutes)",
    "moeserve demo": "the real demo model: test_tiny_and_upcycle.py::test_demo_command",
    "moeserve bench": "GPU benchmarks",
}


def fenced_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def commands(block: str) -> list[str]:
    """The commands of a bash block: comments dropped, continuation lines and multi-line quotes joined."""
    out, pending = [], ""
    for line in block.splitlines():
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            words = shlex.split(pending.replace("\\\n", " "), comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            out.append(shlex.join(words))
        pending = ""
    assert not pending.strip(), f"unterminated command in README: {pending!r}"
    return out


def bash_commands() -> list[str]:
    return [c for block in fenced_blocks("bash") for c in commands(block)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: str, env: dict, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """A README command in a shell, with `moeserve` meaning this checkout's CLI on this Python."""
    cmd = re.sub(r"^moeserve\b", shlex.quote(sys.executable) + " -m moeserve", cmd)
    return subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A private cache whose 'demo model' is a tiny Mixtral with caps/brief adapters trained by demo.py."""
    cache = tmp_path_factory.mktemp("first_hour_cache")
    model = make_tiny("mixtral", cache / DEMO_MODEL_NAME)
    canned = [("The sky is blue. It scatters light.", True), ("Paris is the capital. It is in France.", True)]
    orig = demo._base_answers
    demo._base_answers = lambda model_dir, prompts: canned  # the tiny model's own answers are noise
    try:
        built = demo.build_demo_adapters(model, prompts=demo.TRAIN_PROMPTS[:2], epochs=1, progress=False)
    finally:
        demo._base_answers = orig
    assert set(built) == set(demo.DEMO_ADAPTERS)
    env = {**os.environ, "MOESERVE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    return cache, model, env


def test_every_readme_command_is_run_or_listed():
    known = ("moeserve make-tiny", "moeserve generate", "moeserve serve", "curl ")
    commands = bash_commands()
    assert any(c.startswith("moeserve serve") for c in commands) and any(c.startswith("curl") for c in commands)
    for cmd in commands:
        assert cmd.startswith(known) or any(cmd.startswith(p) for p in NOT_RUN), \
            f"README command {cmd!r}: run it in test_first_hour.py or list it in NOT_RUN"
    for path in ("scripts/demo.sh", "scripts/test.sh", "scripts/setup.sh"):
        assert (REPO / path).is_file()
    assert "scripts/test.sh" in (REPO / ".ci/run").read_text()  # "`.ci/run` runs the same test command"


def test_make_tiny_and_generate_as_written(tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tiny = str(tmp_path / "tiny")
    cmds = [c.replace("/tmp/tiny", tiny) for c in bash_commands() if c.startswith(("moeserve make-tiny",
                                                                                        "moeserve generate"))]
    assert [c.split()[1] for c in cmds] == ["make-tiny", "make-tiny", "generate"]  # plain, FP8, then generate
    # each command a process of its own as written, but the FP8 make-tiny: the same `moeserve make-tiny` in this
    # process (cli.main, what `python -m moeserve` calls), sparing a start that imports transformers' models (~5 s)
    for cmd in cmds:
        if "--quantization fp8" in cmd:
            assert cli.main(shlex.split(cmd)[1:]) == 0, cmd
            continue
        r = run(cmd, env)
        assert r.returncode == 0, (cmd, r.stderr)
    assert "--- the quick brown fox" in r.stdout
    assert json.loads((tmp_path / "tiny-fp8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"

    # the same make-tiny again (in-process, as a subprocess costs seconds): refused by name, no traceback
    argv = shlex.split(cmds[0])[1:]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a model" in err and "--force" in err
    (tmp_path / "file").write_text("x")
    assert cli.main([a.replace(tiny, str(tmp_path / "file")) for a in argv]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert cli.main(argv + ["--force"]) == 0


def test_python_api_snippet_as_written(stand_in, monkeypatch, capsys):
    """Run in this process: its code is the library's, and a fresh interpreter would add only its start (~3 s; the
    package imported fresh is every `python -m moeserve` test's)."""
    cache, _, _ = stand_in
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(cache))
    snippet = next(b for b in fenced_blocks("python") if "from moeserve import" in b)
    namespace = {"__name__": "__main__"}
    exec(compile(snippet, "README.md", "exec"), namespace)
    namespace["engine"].shutdown()
    assert capsys.readouterr().out.strip().endswith(("stop", "length"))


def _start(cmd: str, port: int, env: dict, log: Path) -> subprocess.Popen:
    cmd = re.sub(r"^moeserve\b", shlex.quote(sys.executable) + " -m moeserve", cmd)
    proc = subprocess.Popen(f"exec {cmd} --port {port}", shell=True, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, f"{cmd} exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise AssertionError(f"{cmd} did not come up: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_server_examples_as_written(stand_in, tmp_path):
    """Each `moeserve serve` of the README, then the curl commands and python snippets that follow it, in order,
    against that server (on a free port instead of 8000)."""
    _, _, env = stand_in
    steps = []  # ("serve" | "curl" | "python", text) in README order
    for lang, block in re.findall(r"^```(bash|python)\n(.*?)^```", README, re.S | re.M):
        if lang == "python" and "OpenAI(" in block:
            steps.append(("python", block))
        elif lang == "bash":
            steps += [("serve" if c.startswith("moeserve serve") else "curl", c) for c in commands(block)
                      if c.startswith(("moeserve serve", "curl"))]
    assert [k for k, _ in steps].count("serve") == 2 and [k for k, _ in steps].count("curl") == 3

    proc = None
    try:
        for kind, text in steps:
            if kind == "serve":
                if proc is not None:
                    _stop(proc)
                port = free_port()
                proc = _start(text, port, env, tmp_path / f"serve{port}.log")
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
                assert [m["id"] for m in models] == [DEMO_MODEL_NAME, "caps", "brief"]
                continue
            text = text.replace("localhost:8000", f"127.0.0.1:{port}")
            if kind == "python":
                r = run(f"{shlex.quote(sys.executable)} -c {shlex.quote(text)}", env)
                assert r.returncode == 0, r.stderr
                continue
            r = run(text + " -w '\\n%{http_code}'", env)
            assert r.returncode == 0, r.stderr
            body, _, status = r.stdout.rpartition("\n")
            assert status == "200", (text, r.stdout)
            if "chat/completions" in text:
                assert '"choices"' in body
            else:
                assert body.startswith("Success"), body
        names = [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]]
        assert names == [DEMO_MODEL_NAME, "caps", "brief"]  # shout loaded, then unloaded
    finally:
        if proc is not None:
            _stop(proc)
