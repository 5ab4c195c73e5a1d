"""`moeserve serve` as a service: its listening socket bound before the model loads, and stopping on SIGTERM
(systemd, docker stop, Kubernetes) exactly as on SIGINT (Ctrl-C).

A stop signal while the engine starts abandons the start. While serving, the first one stops accepting connections
and gives the requests in flight up to --shutdown-timeout seconds to finish; then, or at a second signal, they are
aborted (each response ends with finish_reason "abort"). The engine core is stopped after the HTTP server, and the
process exits 0. uvicorn's own signal handling is left out: it re-raises the signal once the server has stopped,
and a re-raised SIGTERM killed the process before it could stop the engine core.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading

import uvicorn

logger = logging.getLogger("moeserve")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 5.0  # after the abort, how long responses may take to end before connections are dropped


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A socket bound to host:port and listening (connections wait in the backlog until the server runs), or a
    ValueError naming the flags: a port in use is found before minutes of model loading, not after."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port just freed by a stopped server is free
        sock.bind((host, port))
        sock.listen(backlog)
    except (OSError, OverflowError) as e:
        sock.close()
        if isinstance(e, OverflowError):
            reason = "a port is a number from 0 to 65535"
        elif isinstance(e, socket.gaierror):
            reason = f"unknown host ({e.strerror})"
        else:
            reason = {errno.EADDRINUSE: "the port is in use (another server is listening there; pick another --port)",
                      errno.EACCES: "permission denied (ports below 1024 need privileges)",
                      errno.EADDRNOTAVAIL: "no such address on this machine"}.get(e.errno, e.strerror or str(e))
        raise ValueError(f"cannot listen on {where} (--host, --port): {reason}") from None
    sock.set_inheritable(False)  # the engine core and its workers must not hold the port
    return sock


class ServerWithoutSignals(uvicorn.Server):
    """uvicorn's Server minus its signal handlers (StopSignals handles them, for the whole run)."""

    def capture_signals(self):
        return contextlib.nullcontext()


class StopSignals:
    """SIGINT and SIGTERM call `on_stop(signal name, how many so far)` on the event loop. Installed only on the
    main thread (a server run in a thread, as tests do, is stopped through `server.should_exit`)."""

    def __init__(self, on_stop=None):
        self.on_stop = on_stop
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                self._loop.add_signal_handler(sig, self._received, sig)
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            for sig in STOP_SIGNALS:
                self._loop.remove_signal_handler(sig)

    def _received(self, sig: signal.Signals) -> None:
        self.received += 1
        if self.on_stop is not None:
            self.on_stop(signal.Signals(sig).name, self.received)


class Drain:
    """How a running server stops: `stop()` (first signal) closes the listening socket and lets requests in flight
    finish for up to `timeout` seconds; after that, or at the next stop(), every open request is aborted, and
    requests that arrive on connections still open are too, until the server has finished."""

    def __init__(self, server: uvicorn.Server, engine, timeout: float):
        self.server, self.engine, self.timeout = server, engine, timeout
        self._aborting: asyncio.Task | None = None

    def stop(self, why: str, count: int) -> None:
        loop = asyncio.get_running_loop()
        in_flight = len(self.engine.streams)
        if count == 1:
            self.server.should_exit = True
            if in_flight and self.timeout > 0:
                logger.info("%s: stopping; %d request(s) in flight get up to %g s to finish (%s again aborts them)",
                            why, in_flight, self.timeout, why)
            self._aborting = loop.create_task(self._abort_after(self.timeout))
        elif self._aborting is not None:
            self._aborting.cancel()
            self._aborting = loop.create_task(self._abort_after(0.0))

    async def _abort_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        aborted = self.engine.abort_all()
        if aborted:
            logger.info("stopping: aborted %d request(s) still in flight", aborted)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ABORT_GRACE_S
        while loop.time() < deadline:
            await asyncio.sleep(0.1)
            self.engine.abort_all()  # a request whose body was still arriving
        self.server.force_exit = True  # a client that does not read its response's end no longer holds the stop

    def cancel(self) -> None:
        if self._aborting is not None:
            self._aborting.cancel()


def stop_resource_tracker() -> None:
    """multiprocessing's resource tracker, started with the engine core, exits only when this process does, so it
    would outlive it for a moment: an orphan, and a zombie under a PID 1 that reaps nothing (a container). Stopped
    and reaped here instead, once the core is gone."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()
