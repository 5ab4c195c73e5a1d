"""Connection hygiene for the HTTP server: deadlines for reading a request, a cap on open connections, a cap
on request bodies (repeated log lines are rate-limited by moeserve/log_filter.py).

uvicorn has a keep-alive timeout but none for a connection that is still sending its request: one that
trickles its headers (or body) a byte at a time holds a socket forever, and enough of them exhaust the
process's descriptors (then asyncio's accept loop logs an error per attempt). So each connection gets:
- a header deadline: from the connection opening, or from the first byte of a request on a kept-alive
  connection, until its headers are complete;
- a body deadline: from the headers until the whole body has arrived;
- a place under the connection cap, or an immediate 503 and close (before anything is parsed).
A deadline that passes closes the connection (with 408 if a request had started and no response has).
Load shedding: `shed(method, path, head)` sees a request's first packet, when it holds the whole head, before
any HTTP parsing; a response it returns is written and the connection closed (a 503 for a full queue then
costs a few microseconds instead of a trip through the HTTP parser and the web framework).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Callable

Shed = Callable[[bytes, bytes, bytes], "bytes | None"]

logger = logging.getLogger("moeserve")

_FD_HEADROOM = 512  # descriptors kept for the engine's files, sockets and the event loop itself
_LINGER_S = 2.0  # how long a connection answered early may still send what it was sending


def _flag(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


@dataclass
class HTTPLimits:
    timeout_header: float = 10.0  # seconds to receive a request's headers
    timeout_body: float = 60.0  # seconds to receive a request's body once its headers are in
    timeout_keep_alive: float = 75.0  # idle seconds before a kept-alive connection is closed
    limit_concurrency: int | None = None  # open connections; None = what the descriptor limit allows
    max_request_body_bytes: int = 4 << 20  # larger bodies are answered 413 before they are read

    def __post_init__(self):
        for name in ("timeout_header", "timeout_body", "timeout_keep_alive"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{_flag(name)} must be a positive number of seconds, got {v!r}")
        if self.limit_concurrency is not None and (not isinstance(self.limit_concurrency, int)
                                                   or self.limit_concurrency <= 0):
            raise ValueError(f"{_flag('limit_concurrency')} must be a positive integer, got {self.limit_concurrency!r}")
        if not isinstance(self.max_request_body_bytes, int) or self.max_request_body_bytes <= 0:
            raise ValueError(f"{_flag('max_request_body_bytes')} must be a positive integer, got "
                             f"{self.max_request_body_bytes!r}")

    def connection_cap(self) -> int:
        if self.limit_concurrency is not None:
            return self.limit_concurrency
        return max(64, open_files_limit() - _FD_HEADROOM)


def open_files_limit() -> int:
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024


def raise_open_files_limit(want: int = 65536) -> int:
    """Raise the soft descriptor limit towards the hard one (as vLLM does); returns the soft limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError) as e:
        logger.warning("could not raise the open-files limit: %s", e)
    return open_files_limit()


def raw_response(status: str, body: dict | None, extra: str = "") -> bytes:
    """A complete HTTP/1.1 response that closes the connection; `extra`: more header lines, each ending CRLF."""
    data = json.dumps(body, ensure_ascii=True).encode() if body is not None else b""
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n{extra}"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + data


_BUSY = raw_response("503 Service Unavailable", {"error": {
    "message": "too many open connections; retry later", "type": "server_error", "param": None,
    "code": "too_many_connections"}}, "retry-after: 1\r\n")
_TIMEOUT = raw_response("408 Request Timeout", {"error": {
    "message": "the request was not received in time", "type": "invalid_request_error", "param": None,
    "code": "request_timeout"}})


class _GuardedProtocol:
    """Mixed into uvicorn's h11 or httptools protocol (it relies on their `cycle`, `transport`, `loop`,
    `server_state` and `on_response_complete`, alike in both)."""

    limits: HTTPLimits
    cap: int
    shed: Shed | None = None

    _refused = False  # over the connection cap: never handed to uvicorn's protocol
    _shed_done = False  # answered by `shed`: closing
    _header_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _seen_cycle = None  # the request cycle current when we last looked
    _partial = False  # bytes of a request whose headers are incomplete have arrived

    def connection_made(self, transport) -> None:
        if len(self.server_state.connections) >= self.cap:
            # refused before any parsing, so a flood costs one short write per connection
            self._refused = True
            self._answer_and_close(transport, _BUSY)
            logger.warning("refusing new connections: %d are open, the limit", self.cap)  # one line per burst
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        for timer in (self._header_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._linger_timer = None
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._shed_done:
            return
        if self.cycle is None or self.cycle.response_complete:  # bytes of the next request
            if not self._partial and self.shed is not None and self._shed(data):
                return
            self._partial = True
            if self._header_timer is None:  # a kept-alive connection starts a request: the clock starts now
                self._arm_header_timer()
        super().data_received(data)
        self._check_new_request()

    def _shed(self, data: bytes) -> bool:
        end = data.find(b"\r\n\r\n")
        if end < 0:  # the head came in pieces: the ordinary path decides
            return False
        line, _, _ = data.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3:
            return False
        response = self.shed(parts[0], parts[1].partition(b"?")[0], data[:end])
        if response is None:
            return False
        self._shed_done = True  # nothing more is read from this connection
        self._answer_and_close(self.transport, response)
        return True

    def _answer_and_close(self, transport, response: bytes) -> None:
        """Write `response`, then close our side only: closing a socket whose client is still sending (the rest of
        a body) would reset it, and a reset can destroy the response before the client reads it. The client's
        close (or the linger timer) ends the connection; what it still sends is dropped."""
        transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
            self._linger_timer = self.loop.call_later(_LINGER_S, transport.close)
        else:
            transport.close()

    def on_response_complete(self) -> None:
        cycle = self.cycle  # on httptools, a pipelined request after the one just answered: not complete
        if cycle is not None and cycle.response_complete and cycle.more_body and not self.transport.is_closing():
            # answered before its body was read in full (413, an early refusal): read no more of it, and close once
            # the client has the answer
            self._shed_done = True
            self._answer_and_close(self.transport, b"")
            return
        super().on_response_complete()
        self._check_new_request()  # a pipelined request may have started

    def _arm_header_timer(self) -> None:
        self._seen_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.limits.timeout_header, self._header_timeout)

    def _queued(self, cycle) -> bool:
        """httptools parses a pipelined request while the one before it is answered and queues it (reading
        paused); h11 parses it only once that answer is done, so never queues."""
        return any(c is cycle for c, _ in getattr(self, "pipeline", ()))

    def _check_new_request(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle is self._seen_cycle or self._queued(cycle):
            return  # a queued request's deadlines start when it runs: its body is not read before
        self._seen_cycle = cycle
        self._partial = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if cycle.more_body:
            self._body_timer = self.loop.call_later(self.limits.timeout_body, self._body_timeout, cycle)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._seen_cycle:
            return
        if self._partial:
            self.transport.write(_TIMEOUT)
        self.transport.close()
        logger.warning("closed a connection that sent no complete request headers within %gs",
                       self.limits.timeout_header)

    def _body_timeout(self, cycle) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is not cycle or not cycle.more_body:
            return
        if not cycle.response_started:
            self.transport.write(_TIMEOUT)
        self.transport.close()  # the app reading the body sees a disconnect
        logger.warning("closed a connection that sent no complete request body within %gs", self.limits.timeout_body)


def guarded_protocol_class(limits: HTTPLimits, shed: Shed | None = None, http: str = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol (`http`: "httptools", "h11", or "auto": httptools where installed, else h11)
    with `limits` enforced and `shed` consulted; one class per server, so these travel with it rather than in
    module state."""
    if http not in ("auto", "httptools", "h11"):
        raise ValueError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
    base = None
    if http != "h11":
        try:
            import httptools  # noqa: F401
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:
            if http == "httptools":
                raise
    if base is None:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"Guarded{base.__name__}", (_GuardedProtocol, base),
                {"limits": limits, "cap": limits.connection_cap(), "shed": staticmethod(shed) if shed else None})


def _too_large(max_bytes: int) -> bytes:
    return json.dumps({"error": {
        "message": f"request body is larger than this server accepts ({max_bytes} bytes, --max-request-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()


def limit_request_body(app, max_bytes: int):
    """ASGI middleware: a request body over `max_bytes` is answered 413 before it is read in full — at once when
    its Content-Length says so (h11 holds a body to its declared length), else (chunked) as soon as the bytes
    received pass the limit; such a body is read here, as the framework would read it anyway, and replayed."""
    async def send_413(send) -> None:
        body = _too_large(max_bytes)
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def limited(scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await app(scope, receive, send)
        headers = dict(scope["headers"])  # names arrive lower-cased
        declared = headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > max_bytes:
                return await send_413(send)
            return await app(scope, receive, send)
        if b"transfer-encoding" not in headers:  # no body
            return await app(scope, receive, send)
        chunks, size, message = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees that next
            size += len(message.get("body", b""))
            if size > max_bytes:
                return await send_413(send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replay = [message]

        async def replayed():
            return replay.pop() if replay else await receive()

        return await app(scope, replayed, send)

    return limited
