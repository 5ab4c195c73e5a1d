"""Reliability under hostile input and overload (issue 15), against a real server on loopback (tiny model, CPU):
slow connections, floods refused fast, size limits checked before tokenizing, disconnects, lone surrogates,
runtime adapter loading opt-in and confined, errors without filesystem paths, the CLI's --lora-modules.

Timing numbers are printed (run with -s to see them); the bounds asserted are the issue's (1 s)."""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import httpx
import pytest

pytest.importorskip("uvicorn")

import server_harness  # noqa: E402
from moeserve import EngineConfig  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from moeserve.server.app import (Admission, add_serve_args, http_limits_from_args, resolve_adapter_path,  # noqa: E402
                                 run_on_server_loop, run_server)
from moeserve.errors import AdapterPathError  # noqa: E402
from moeserve.server.metrics import ServerMetrics  # noqa: E402
from moeserve.log_filter import RepeatFilter  # noqa: E402
from moeserve.server.connections import HTTPLimits, guarded_protocol_class  # noqa: E402
from moeserve.server.errors import redact_paths  # noqa: E402
from moeserve.server.protocol import MAX_MESSAGES, MAX_N, MAX_STOP, MAX_STOP_CHARS  # noqa: E402
from server_harness import RunningServer, wait_until  # noqa: E402

# latency bounds under load (1 s), and the tests sharing their servers or timing deadlines: scripts/test.sh runs these
# alone, after the parallel run; the others here (adapter paths, redaction, flags, dtypes, log filters) run in it
serial = pytest.mark.serial

MODEL = "tiny-moe"
MAX_MODEL_LEN = 128
MAX_QUEUE_LEN = 64
ENGINE_KW = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=320, max_num_seqs=64, block_size=16,
                 max_queue_len=MAX_QUEUE_LEN)
TIMEOUT = 1.5  # header and body deadlines of the test servers (10 s and 60 s by default)
LIMITS = HTTPLimits(timeout_header=TIMEOUT, timeout_body=TIMEOUT)


def start_server(config: EngineConfig, limits: HTTPLimits) -> RunningServer:
    """RunningServer with connection limits (the harness's run_server takes none of its own)."""
    async def with_limits(*args, **kw):
        return await run_server(*args, limits=limits, **kw)

    with mock.patch.object(server_harness, "run_server", with_limits):
        return RunningServer(config, MODEL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_reliability"))


@pytest.fixture(scope="module")
def server(model_dir):
    # bodies up to 64 MB: the size limits checked after parsing (prompt, stop, messages) are exercised with bodies
    # larger than the default cap (4 MiB, tested on impatient_server)
    s = start_server(EngineConfig(model=str(model_dir), **ENGINE_KW), HTTPLimits(max_request_body_bytes=64 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def impatient_server(model_dir):
    """Short header and body deadlines (a flood would trip them: its requests wait in the accept queue)."""
    s = start_server(EngineConfig(model=str(model_dir), **ENGINE_KW), LIMITS)
    yield s
    s.close()


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# slow connections: header and body deadlines, a connection cap, rate-limited logs
# ---------------------------------------------------------------------------------------------

def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (EOF, after any 408 it wrote)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@serial
def test_slow_header_and_body_connections_do_not_block_and_are_closed(impatient_server, caplog):
    """200 connections trickling their headers and 20 trickling a body are held open; /health and a real
    completion still answer within 1 s, and the server closes every one of them after its deadline."""
    server = impatient_server
    host, port = server.url.removeprefix("http://").split(":")
    caplog.set_level(logging.WARNING, logger="moeserve")
    warm = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert server.http.post("/v1/completions", json=warm).status_code == 200  # first-call costs out of the way
    _, baseline = timed(lambda: server.http.post("/v1/completions", json=warm))
    slow, t_open = [], time.monotonic()
    for i in range(220):
        s = socket.create_connection((host, int(port)))
        if i < 200:  # an unfinished head
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        else:  # a whole head, then a body that never completes
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": ")
        slow.append(s)
    worst_health = worst_completion = 0.0
    closed_at: dict[int, float] = {}
    deadline = t_open + TIMEOUT + 5
    while len(closed_at) < len(slow) and time.monotonic() < deadline:
        for i, s in enumerate(slow):  # one more byte from each: trickling must not extend a deadline
            if i not in closed_at:
                try:
                    s.send(b"X" if i < 200 else b" ")
                except OSError:
                    pass
        r, dt = timed(lambda: server.http.get("/health"))
        assert r.status_code == 200
        worst_health = max(worst_health, dt)
        if worst_completion == 0.0:
            r, dt = timed(lambda: server.http.post("/v1/completions", json=warm))
            assert r.status_code == 200, r.text
            worst_completion = dt
        for i, s in enumerate(slow):
            if i not in closed_at and _closed_by_server(s):
                closed_at[i] = time.monotonic() - t_open
        time.sleep(0.2)
    for s in slow:
        s.close()
    print(f"\nslow connections: /health worst {worst_health * 1e3:.0f} ms, completion {worst_completion * 1e3:.0f} ms "
          f"(alone {baseline * 1e3:.0f} ms), "
          f"closed after {min(closed_at.values(), default=0):.2f}-{max(closed_at.values(), default=0):.2f} s "
          f"(deadline {TIMEOUT} s)")
    assert worst_health < 1.0
    # the engine's own speed is not under test: on a machine where a completion alone takes longer, no slower
    assert worst_completion < max(1.0, 3 * baseline), (worst_completion, baseline)
    assert len(closed_at) == len(slow), f"{len(slow) - len(closed_at)} slow connections still open"
    assert min(closed_at.values()) >= TIMEOUT * 0.9
    # 220 closes, but the log says so a handful of times, not 220
    closes = [r for r in caplog.records if "closed a connection" in r.getMessage()]
    assert 1 <= len(closes) <= 4, [r.getMessage() for r in closes]
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200


@serial
def test_keep_alive_connection_between_requests_is_not_cut_by_the_header_deadline(impatient_server):
    server = impatient_server
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        time.sleep(TIMEOUT + 0.5)  # idle between requests: the keep-alive timeout's business, not the header one's
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


@contextmanager
def _plain_uvicorn(limits: HTTPLimits, shed=None, http: str = "auto"):
    """uvicorn with the guarded protocol around a trivial ASGI app (no engine): connection-level behaviour only.
    The app answers "ok" and the request's body; GET /slow answers four chunks 0.4 s apart."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/slow":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(4):
                await send({"type": "http.response.body", "body": b"chunk%d;" % i, "more_body": True})
                await asyncio.sleep(0.4)
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(2 + len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"ok" + body})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           http=guarded_protocol_class(limits, shed, http)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@serial
def test_connections_over_the_cap_are_answered_503_and_closed_at_once():
    with _plain_uvicorn(HTTPLimits(limit_concurrency=20, timeout_header=30)) as port:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(1)
        t0 = time.perf_counter()
        data = b""
        while chunk := extra.recv(4096):
            data += chunk
        assert time.perf_counter() - t0 < 1
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        extra.close()
        idle.pop().close()
        time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200  # a place freed up
        for s in idle:
            s.close()


@serial
@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_the_guard_works_on_either_uvicorn_http_protocol(http):
    """The guard is mixed into uvicorn's httptools protocol (what the server runs) or, where httptools is missing,
    its h11 one: on both, a shed request is answered at its first packet, a whole head split over packets and a
    kept-alive second request reach the app, a trickled head is answered 408 at its deadline, and a connection
    over the cap is refused 503 before anything is parsed."""
    refusal = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

    def shed(method, path, head):
        return refusal if (method, path) == (b"POST", b"/shed") else None

    limits = HTTPLimits(limit_concurrency=4, timeout_header=0.5)
    base = {"h11": "H11Protocol", "httptools": "HttpToolsProtocol"}[http]
    assert base in [c.__name__ for c in guarded_protocol_class(limits, shed, http).__mro__]
    with _plain_uvicorn(limits, shed, http) as port:
        def connect():
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(5)
            return s

        with connect() as s:
            s.sendall(b"POST /shed HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n")
            assert _read_response(s) == (refusal.partition(b"\r\n\r\n")[0], b"")
        with connect() as s:
            s.sendall(b"GET / HTTP/1.1\r\nHo")
            time.sleep(0.1)
            s.sendall(b"st: x\r\n\r\n")
            head, body = _read_response(s)
            assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
            s.sendall(b"GET /shed HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive; not what shed refuses
            head, body = _read_response(s)
            assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
        t0 = time.perf_counter()  # before the server's clock starts (at accept)
        with connect() as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            head, _ = _read_response(s)
            assert head.startswith(b"HTTP/1.1 408") and time.perf_counter() - t0 >= 0.5
        idle = [connect() for _ in range(4)]
        for s in idle:  # kept alive after a request: no header deadline closes them while the fifth arrives
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s)[1] == b"ok"
        with connect() as extra:
            head, body = _read_response(extra)
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
        for s in idle:
            s.close()


def test_the_server_runs_on_uvloop():
    """uvloop is a dependency (connections are answered ~2x faster than on asyncio's loop), run through
    uvloop.run: asyncio.Runner, which Python 3.10 lacks, is not needed."""
    async def loop_module():
        return type(asyncio.get_running_loop()).__module__

    assert run_on_server_loop(loop_module()).startswith("uvloop")


class _Pipelined:
    """Responses read one after another from one connection (http.client reads one response per object and
    closes its file when done: here they share one buffered file that is not closed)."""

    class _File:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def close(self):
            pass

    def __init__(self, sock: socket.socket):
        self.file = self._File(sock.makefile("rb"))

    def makefile(self, *args, **kwargs):
        return self.file

    def next(self) -> tuple[int, bytes]:
        r = http.client.HTTPResponse(self)
        r.begin()
        return r.status, r.read()


@serial
@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_pipelined_requests_are_answered_in_order_whatever_their_bodies_wait_for(http):
    """A request sent behind another before that one is answered (HTTP/1.1 pipelining) is answered after it, in
    full: when its body is still arriving as the first answer ends, and when the first answer outlasts the body
    deadline (httptools parses the second request early: its deadline runs from when it is served, not parsed)."""
    with _plain_uvicorn(HTTPLimits(timeout_body=1.0), None, http) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            responses = _Pipelined(s)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 10\r\n\r\nabc")
            time.sleep(0.3)  # the first answer is done before the rest of the second body arrives
            s.sendall(b"defghij")
            assert responses.next() == (200, b"ok")
            assert responses.next() == (200, b"okabcdefghij")
            # the first answer takes 1.6 s, past the second request's 1 s body deadline
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 10\r\n\r\nabc")
            assert responses.next() == (200, b"chunk0;chunk1;chunk2;chunk3;")
            s.sendall(b"defghij")
            assert responses.next() == (200, b"okabcdefghij")


def test_repeated_log_lines_are_rate_limited():
    now = [0.0]
    f = RepeatFilter(interval=10.0, clock=lambda: now[0])

    def rec(msg, level=logging.WARNING, name="asyncio"):
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    assert f.filter(rec("socket.accept() out of system resource\nsocket: <fd=6>"))
    passed = sum(f.filter(rec(f"socket.accept() out of system resource\nsocket: <fd={i}>")) for i in range(1000))
    assert passed == 0
    assert f.filter(rec("another message"))  # keyed by message
    assert f.filter(rec("socket.accept() out of system resource", logging.INFO))  # quieter levels pass
    now[0] = 10.5
    r = rec("socket.accept() out of system resource\nsocket: <fd=7>")
    assert f.filter(r) and "1000 more like this suppressed" in r.getMessage()


def _assert_413(head: bytes, body: bytes) -> None:
    assert head.startswith(b"HTTP/1.1 413 "), head
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "--max-request-body-bytes" in err["message"], err


@serial
def test_request_body_over_the_cap_is_413_before_it_is_read(impatient_server):
    """Default cap (4 MiB): a declared 50 MB body is answered 413 after 1 MB of it was sent; a chunked body
    as soon as it passes the cap; the server keeps answering, and bodies under the cap are served."""
    server = impatient_server
    host, port = server.url.removeprefix("http://").split(":")
    cap = HTTPLimits().max_request_body_bytes
    for path in ("/v1/completions", "/v1/load_lora_adapter"):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {50 * 10**6}\r\n\r\n".encode() + b" " * 10**6)
            _assert_413(*_read_response(s))  # 49 MB of the body never sent
            s.sendall(b" " * 65536)  # what the client still sends is dropped, then the server closes
            wait_until(lambda: _closed_by_server(s), timeout=10)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b" " * 65536
        for _ in range(cap // len(chunk) + 2):  # just past the cap, no final chunk: the answer must not wait for it
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        _assert_413(*_read_response(s))
    # under the cap, chunked or not: served
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "x" * (cap // 2)}).encode()
    assert server.http.post("/v1/completions", content=body, headers={"content-type": "application/json"}
                            ).status_code == 200
    assert server.http.post("/v1/completions", content=iter([body[:1000], body[1000:]]),
                            headers={"content-type": "application/json"}).status_code == 200
    assert server.http.get("/health").status_code == 200


def test_core_process_rate_limits_repeated_log_lines(model_dir, capfd):
    """The engine-core process filters its log as the frontend does (moeserve/log_filter.py): six failed steps in a
    row, one 'engine step failed' line (with its traceback) in the core's stderr, not six."""
    s = start_server(EngineConfig(model=str(model_dir), **ENGINE_KW), HTTPLimits())  # its core writes to capfd
    try:
        s.fail_next_steps(6, "injected device fault")
        for _ in range(6):
            r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 500 and "injected device fault" in r.text, r.text
        assert s.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                           ).status_code == 200
    finally:
        s.close()
    err = capfd.readouterr().err
    assert err.count("injected device fault") >= 1  # the core's log is what was captured
    assert 1 <= err.count("engine step failed; failing the running requests") <= 2, err  # 2: a 10 s interval passed


# ---------------------------------------------------------------------------------------------
# overload is refused fast; size limits before tokenizing; disconnects abort every choice
# ---------------------------------------------------------------------------------------------

# The flood runs in its own process (it must not share the server's interpreter lock) on bare asyncio protocols
# (an HTTP client library's own overhead would be measured too). Each latency is from the request's write to the
# first byte of its response; the flood client's own lag counts against the server.
FLOOD_CLIENT = r"""
import asyncio, json, sys, time
host, port, n, body, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
req = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
       f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}").encode()
results, refused = [], None

class One(asyncio.Protocol):
    def connection_made(self, t):
        self.sent, self.first, self.data = time.perf_counter(), None, b""
        t.write(req)
    def data_received(self, d):
        if self.first is None:
            self.first = time.perf_counter()
        self.data += d
    def connection_lost(self, exc):
        self.done.set_result(None)

async def one(loop):
    p = One()
    p.done = loop.create_future()
    try:
        t, _ = await loop.create_connection(lambda: p, host, port)
        await asyncio.wait_for(p.done, 120)
        head, _, payload = p.data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        ok = status != 503 or (b"retry-after: 1" in head.lower() and json.loads(payload)["error"]["code"] == "queue_full")
        results.append([status, p.first - p.sent, ok])
    except Exception as e:
        results.append([-1, 0.0, repr(e)])
    if len(results) == n - held:
        refused.set_result(time.perf_counter())

async def main():
    global refused
    loop = asyncio.get_running_loop()
    refused = loop.create_future()
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(loop)) for _ in range(n)]
    try:
        t1 = await asyncio.wait_for(asyncio.shield(refused), 60)
    except asyncio.TimeoutError:
        t1 = float("nan")
    print("REFUSED", t1 - t0, flush=True)
    await asyncio.gather(*tasks)
    print(json.dumps({"results": results, "refused_s": t1 - t0}), flush=True)

asyncio.run(main())
"""


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP response with a content-length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head, body


class HealthProbe(threading.Thread):
    """GET /health every 20 ms on one kept-alive connection, as a load balancer would; latencies in `times`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(30)
        self.times: list[tuple[int, float]] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _ = _read_response(self.sock)
            self.times.append((int(head.split(b" ", 2)[1]), time.perf_counter() - t0))
            time.sleep(0.02)

    def close(self) -> list[tuple[int, float]]:
        self.stop.set()
        self.join(30)
        self.sock.close()
        return self.times


@serial
def test_5000_concurrent_requests_beyond_the_queue_are_refused_within_1s(server):
    """The engine is held: the first max_queue_len requests wait in the queue, every other one of 5,000 concurrent
    requests is answered 503 queue_full with Retry-After within 1 s, and /health answers within 1 s throughout."""
    n = 5000
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    server.wait_idle()
    with server.engine_paused():
        probe = HealthProbe(server.url)
        probe.start()
        proc = subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, host, port, str(n), body, str(MAX_QUEUE_LEN)],
                                stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # every refusal is in; the held requests run once the engine goes on
        health = probe.close()
    out, _ = proc.communicate(timeout=120)
    assert first.startswith("REFUSED"), first
    data = json.loads(out)
    res = data["results"]
    statuses = Counter(r[0] for r in res)
    refused = [r for r in res if r[0] == 503]
    worst = max(r[1] for r in refused)
    print(f"\nflood of {n}: {statuses}; every refusal in after {data['refused_s']:.2f} s; worst 503 latency "
          f"{worst * 1e3:.0f} ms (p50 {sorted(r[1] for r in refused)[len(refused) // 2] * 1e3:.0f} ms); "
          f"/health worst {max(h[1] for h in health) * 1e3:.0f} ms over {len(health)} probes")
    assert statuses == {503: n - MAX_QUEUE_LEN, 200: MAX_QUEUE_LEN}
    assert all(r[2] is True for r in refused)  # queue_full, with Retry-After
    assert worst < 1.0
    assert health and all(h[0] == 200 for h in health) and max(h[1] for h in health) < 1.0
    st = server.wait_idle()
    assert st.kv_blocks_free == st.kv_blocks_total


@serial
def test_queue_full_from_the_app_has_retry_after(server):
    """The refusal's other route (a request whose head arrived in pieces reaches the app): same 503."""
    host, port = server.url.removeprefix("http://").split(":")
    info = server.engine.info
    old, info.max_queue_len = info.max_queue_len, 1
    results = []
    try:
        with server.engine_paused():
            t = threading.Thread(target=lambda: results.append(server.http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})))
            t.start()
            wait_until(lambda: server.engine.queue_room() <= 0)
            with socket.create_connection((host, int(port))) as s:
                body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                time.sleep(0.1)
                s.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                s.settimeout(5)
                head, payload = _read_response(s)
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
            assert json.loads(payload)["error"]["code"] == "queue_full"
        t.join(30)
    finally:
        info.max_queue_len = old
    assert results[0].status_code == 200


def test_shedding_respects_the_api_key():
    """A full queue is refused before parsing, but never to a client with a wrong key (that is a 401)."""
    from moeserve.errors import QueueFullError

    class Engine:
        is_running, room = True, 0

        def queue_room(self):
            return self.room

        def queue_full_error(self):
            return QueueFullError("queue is full (1 waiting requests); retry later")

    state = mock.Mock(engine=Engine(), metrics=ServerMetrics(), api_key="k")
    shed = Admission(state).shed
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s"
    refused = shed(b"POST", b"/v1/chat/completions", head % b"k")
    assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1\r\n" in refused.lower()
    assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["code"] == "queue_full"
    assert shed(b"POST", b"/v1/chat/completions", head % b"wrong") is None
    assert shed(b"GET", b"/health", b"GET /health HTTP/1.1") is None
    state.engine.room = 1
    assert shed(b"POST", b"/v1/chat/completions", head % b"k") is None


BIG = 10_000_000


def _size_cases(max_prompt_chars: int):
    user = {"role": "user", "content": "hi"}
    return [
        ("/v1/completions", {"model": MODEL, "prompt": "x" * (max_prompt_chars + 1)}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * BIG}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", "y" * BIG]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": list(range(1, 10_001))}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": MAX_N + 1}, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["s"] * 100_000}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [1] * 100_000}, "stop_token_ids"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [user] * (MAX_MESSAGES + 1)}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "z" * BIG}]}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [user], "max_completion_tokens": 10**9},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [user], "n": 10**6}, "n"),
    ]


@serial
def test_oversized_requests_are_refused_before_tokenizing(server, monkeypatch):
    calls = []
    tok = server.engine.tokenizer
    for name in ("encode", "chat_ids"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    worst = 0.0
    for endpoint, body, param in _size_cases(server.engine.max_prompt_chars):
        content = json.dumps(body).encode()
        r, dt = timed(lambda: server.http.post(endpoint, content=content, headers={"content-type": "application/json"}))
        assert_error(r, 400, param)
        assert not calls, (endpoint, param)
        worst = max(worst, dt)
    print(f"\noversized requests: worst 400 in {worst * 1e3:.0f} ms (bodies up to {BIG // 10**6} MB)")
    assert worst < 2.0
    # a max_tokens the context cannot hold beside the prompt is refused as OpenAI and vLLM do, not shortened
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN})
    assert_error(r, 400, "max_tokens")
    assert "maximum context length" in r.json()["error"]["message"]
    # what fits still works
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                  "stop": ["s"] * MAX_STOP})
    assert r.status_code == 200, r.text
    # chat without max_tokens fills what the context has room for
    r = server.http.post("/v1/chat/completions", json={"model": MODEL, "ignore_eos": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


@serial
def test_non_streaming_disconnect_aborts_every_choice(server):
    before = server.wait_idle()
    n, max_tokens = 8, 100
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True, "n": n}
    with server.engine_paused():  # it cannot finish before the client gives up
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
        time.sleep(0.1)
    after = server.wait_idle()
    assert after.kv_blocks_free == after.kv_blocks_total
    assert after.aborted_total == before.aborted_total + n
    assert after.generation_tokens_total - before.generation_tokens_total < n * max_tokens // 4


@serial
def test_lone_surrogate_is_400_on_both_endpoints(server):
    raw = {"/v1/completions": b'{"model": "%s", "prompt": "ab\\ud800cd", "max_tokens": 2}',
           "/v1/chat/completions": b'{"model": "%s", "messages": [{"role": "user", "content": "ab\\ud800cd"}]}'}
    for endpoint, body in raw.items():
        r = server.http.post(endpoint, content=body % MODEL.encode(), headers={"content-type": "application/json"})
        err = assert_error(r, 400, "prompt" if "chat" not in endpoint else "messages")
        assert "surrogate" in err["message"]
    for body in (b'{"model": "%s", "prompt": ["ok", "x\\udfff"]}', b'{"model": "%s", "prompt": "x", "stop": "\\ud800"}'):
        r = server.http.post("/v1/completions", content=body % MODEL.encode(), headers={"content-type": "application/json"})
        assert_error(r, 400)
    # an error quoting the client's input stays valid (ASCII-escaped) JSON
    r = server.http.post("/v1/completions", content=b'{"model": "m\\ud800", "prompt": "x"}',
                         headers={"content-type": "application/json"})
    assert_error(r, 404, "model")


# ---------------------------------------------------------------------------------------------
# runtime adapter loading: opt-in, confined to --lora-dir, no filesystem paths in answers
# ---------------------------------------------------------------------------------------------

@serial
def test_runtime_lora_loading_is_off_by_default(server, tmp_path):
    for endpoint, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
                           ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        err = assert_error(server.http.post(endpoint, json=body), 403, code="runtime_lora_loading_disabled")
        assert "--enable-lora-runtime-loading" in err["message"]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("lora_root")
    adapters = root / "adapters"
    adapters.mkdir()
    make_peft_adapter("qwen3_moe", adapters / "good", kind="attn", rank=4, seed=1)
    make_peft_adapter("qwen3_moe", root / "outside", kind="attn", rank=4, seed=2)
    (adapters / "nested").mkdir()
    make_peft_adapter("qwen3_moe", adapters / "nested" / "one", kind="attn", rank=4, seed=3)
    (adapters / "corrupt").mkdir()
    (adapters / "corrupt" / "adapter_config.json").write_text("{not json")
    (adapters / "afile").write_text("x")
    (adapters / "noconfig").mkdir()
    (adapters / "escape").symlink_to(root / "outside")
    return adapters


@pytest.fixture(scope="module")
def lora_server(model_dir, lora_dir):
    s = start_server(EngineConfig(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                  enable_lora_runtime_loading=True, lora_dir=str(lora_dir), **ENGINE_KW), HTTPLimits())
    yield s
    s.close()


def test_lora_dir_loads_by_name_or_inner_path(lora_server, lora_dir):
    s = lora_server
    for name, body in (("good", {}), ("other", {"lora_path": "good"}), ("abs", {"lora_path": str(lora_dir / "good")}),
                       ("nested/one", {})):
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": name, **body})
        assert r.status_code == 200, r.text
        r = s.http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    models = s.http.get("/v1/models").text
    assert str(lora_dir) not in models and "/tmp" not in models
    for name in ("good", "other", "abs", "nested/one"):
        assert s.http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_lora_paths_outside_the_dir_are_refused(lora_server, lora_dir):
    for path in ("/etc", "../outside", str(lora_dir.parent / "outside"), "escape", "nested/../../outside"):
        err = assert_error(lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}),
                           400, "lora_path")
        assert "--lora-dir" in err["message"] and "/" not in err["message"].replace("--lora-dir", ""), err


def test_missing_or_unreadable_adapter_paths_get_one_answer(lora_server, lora_dir):
    answers = set()
    for path in ("missing", "afile", "noconfig", str(lora_dir / "missing" / "deeper")):
        err = assert_error(lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}),
                           404, "lora_path", "adapter_not_found")
        answers.add(err["message"])
    err = assert_error(lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "missing"}), 404, "lora_path")
    answers.add(err["message"])
    assert len(answers) == 1 and "/" not in answers.pop()


def test_adapter_errors_name_no_paths(lora_server, lora_dir):
    err = assert_error(lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "corrupt"}), 400,
                       "lora_path", "invalid_adapter")
    assert "adapter_config.json" in err["message"] and str(lora_dir) not in err["message"]
    assert "/tmp" not in err["message"] and "<path>" in err["message"], err


@pytest.mark.parametrize("name", ["../x", "a b", "x" * 200, "a:b", "/abs", "a//b", "é"])
def test_invalid_adapter_names_are_400(lora_server, name):
    for endpoint in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert_error(lora_server.http.post(endpoint, json={"lora_name": name}), 400, "lora_name")


def test_resolve_adapter_path_without_a_lora_dir(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "adapter_config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    assert resolve_adapter_path("n", str(tmp_path / "ok"), None) == os.path.realpath(tmp_path / "ok")
    for path in ("missing", "file", "empty"):
        with pytest.raises(FileNotFoundError):
            resolve_adapter_path("n", str(tmp_path / path), None)
    with pytest.raises(AdapterPathError, match="lora_path: field required"):  # the app answers it 400 on lora_path
        resolve_adapter_path("n", None, None)


def test_redact_paths():
    assert redact_paths("LoRA adapter 'a' (/srv/x/a): adapter_config.json: bad") == \
        "LoRA adapter 'a' (<path>): adapter_config.json: bad"
    assert redact_paths("request failed: /srv/a b/c: gone", ("/srv/a b/c",)) == "request failed: <path>: gone"
    assert redact_paths("use A-Z a-z 0-9 . _ - /, n/a, 1/2") == "use A-Z a-z 0-9 . _ - /, n/a, 1/2"


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def test_generate_keeps_a_prompt_placed_after_lora_modules(monkeypatch):
    from moeserve import cli

    seen = []
    monkeypatch.setattr(cli, "_generate", lambda args: seen.append(args) or 0)
    both = {"a": "/p", "b": "/q"}
    for argv, prompts, modules in (
        (["generate", "--lora-modules", "a=/p", "b=/q", "what is 2+2?", "--max-tokens", "3"], ["what is 2+2?"], both),
        (["generate", "--lora-modules", "a=/p", "--", "x=y"], ["x=y"], {"a": "/p"}),
        (["generate", "--lora-modules=a=/p", "--lora-modules", "b=/q", "one", "two"], ["one", "two"], both),
    ):
        assert cli.main(argv) == 0
        args = seen.pop()
        assert args.prompt == prompts and dict(args.lora_modules) == modules, argv
    with pytest.raises(SystemExit):
        cli.main(["generate", "--lora-modules", "../bad=/p", "prompt"])


def test_serve_flags_for_connection_limits_and_runtime_loading():
    from moeserve.engine_args import engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--timeout-header", "3", "--timeout-body", "7", "--timeout-keep-alive", "9",
                         "--limit-concurrency", "100", "--enable-lora-runtime-loading", "--lora-dir", "/srv/ad",
                         "--max-request-body-bytes", "1000"])
    assert http_limits_from_args(args) == HTTPLimits(3.0, 7.0, 9.0, 100, max_request_body_bytes=1000)
    cfg = engine_config_from_args(args)
    assert cfg.enable_lora_runtime_loading and cfg.lora_dir == "/srv/ad"
    default = engine_config_from_args(p.parse_args([]))
    assert not default.enable_lora_runtime_loading and default.lora_dir is None
    assert http_limits_from_args(p.parse_args([])) == HTTPLimits()
    with pytest.raises(ValueError):
        HTTPLimits(timeout_header=0)
    with pytest.raises(ValueError):
        HTTPLimits(max_request_body_bytes=0)


def test_adapters_are_checked_against_the_engines_serving_dtype(model_dir, tmp_path):
    """The engine validates an adapter in the dtype it serves in: a factor of 7e4 fits fp32 but not fp16, so the
    same files load into an fp32 engine and are refused, naming the tensor, by an fp16 one."""
    from safetensors.torch import load_file, save_file

    from moeserve import Engine
    from moeserve.lora.adapter import LoRAAdapterError
    from peft_fixtures import make_peft_adapter

    path = make_peft_adapter("qwen3_moe", tmp_path / "a", kind="attn", rank=4, seed=1)[0]
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key].view(-1)[3] = 7e4
    save_file(tensors, str(weights))
    kw = dict(model=str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              num_kv_blocks=16, enforce_eager=True)
    Engine(EngineConfig(dtype="float32", **kw)).load_lora("x", str(path))
    with pytest.raises(LoRAAdapterError, match="overflow the serving dtype torch.float16") as err:
        Engine(EngineConfig(dtype="float16", **kw)).load_lora("x", str(path))
    assert key in str(err.value)
