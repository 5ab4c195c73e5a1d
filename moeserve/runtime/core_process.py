"""The engine core in its own process, and the messages it exchanges with a frontend.

The core loop owns the GPU and nothing else: it takes every message waiting on its input socket,
runs one step (which launches the next forward before reading back the previous one), and sends
one message with everything that step produced. The frontend process (HTTP, tokenizing,
detokenizing, SSE) never shares an interpreter lock with it.

Wire format: msgpack lists over two ZeroMQ PUSH/PULL sockets (ipc://). Frontend -> core:
    ["add", request_id, prompt_token_ids, sampling_params_dict, lora_name]
    ["abort", [request_id, ...], counted]
    ["call", call_id, method, args]          (utility calls, answered by a "reply")
    ["shutdown"]
Core -> frontend:
    ["ready", info] | ["startup_failed", error_type, message]
    ["step", [CoreOutput wire, ...], [accepted ids], [[rejected id, error_type, message], ...], counts]
    ["reply", call_id, ok, result | [error_type, message]]
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import msgpack
import zmq

from moeserve.config import EngineConfig
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")

# utility calls a frontend may make; the test hooks only when MOESERVE_TEST_HOOKS=1 in the core's environment
CALLS = ("load_lora", "unload_lora", "list_loras", "stats")
TEST_CALLS = ("hold", "fail_next_steps")


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def config_to_wire(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def error_wire(e: BaseException) -> list:
    return [type(e).__name__, str(e)]


class CoreServer:
    """The loop around an EngineCore: messages in, one step, one message out."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.accepted: list[str] = []
        self.rejected: list[list] = []
        self.hooks = os.environ.get("MOESERVE_TEST_HOOKS") == "1"

    def _fail_launches(self, n: int, message: str) -> None:
        runner = self.core.runner
        launch = type(runner).launch.__get__(runner)
        left = [n]

        def failing(sb):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError(message)
            return launch(sb)

        runner.launch = failing

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        stalled = False
        while True:
            # sleep on the socket when there is nothing to step (waking now and then to notice an orphaning),
            # and briefly when the last step could schedule nothing (waiting requests, nothing running)
            timeout = (50 if stalled else 0) if self.core.has_work() else 1000
            while poller.poll(timeout):
                if not self.handle(unpack(self.inbox.recv())):
                    return
                timeout = 0
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.error("the frontend process is gone; engine core exiting")
                return
            outputs = self.core.step() if self.core.has_work() else []
            stalled = not outputs and self.core.inflight is None and not self.core.scheduler.running
            if outputs or self.accepted or self.rejected:
                sched = self.core.scheduler
                counts = {"num_running": len(sched.running), "num_waiting": len(sched.waiting)}
                self.outbox.send(pack(["step", [o.to_wire() for o in outputs], self.accepted, self.rejected, counts]))
                self.accepted, self.rejected = [], []

    def handle(self, msg: list) -> bool:
        kind = msg[0]
        if kind == "add":
            _, request_id, ids, params, lora = msg
            try:
                self.core.add_request(ids, SamplingParams(**params), lora, request_id)
                self.accepted.append(request_id)
            except Exception as e:  # noqa: BLE001 - the frontend maps the error type to an HTTP status
                self.rejected.append([request_id, *error_wire(e)])
        elif kind == "abort":
            for request_id in msg[1]:
                self.core.abort(request_id, counted=msg[2])
        elif kind == "call":
            _, call_id, method, args = msg
            try:
                result = self.call(method, args)
                reply = ["reply", call_id, True, result]
            except Exception as e:  # noqa: BLE001 - handed to the caller
                reply = ["reply", call_id, False, error_wire(e)]
            self.outbox.send(pack(reply))
        elif kind == "shutdown":
            return False
        return True

    def call(self, method: str, args: list):
        if method in CALLS:
            return getattr(self.core, method)(*args)
        if self.hooks and method == "hold":  # stop stepping while a flag file exists: requests pile up (tests)
            flag = args[0]
            open(flag + ".held", "w").close()
            deadline = time.monotonic() + 60
            while os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.005)
            return None
        if self.hooks and method == "fail_next_steps":  # the next n launches raise, as a device fault would (tests)
            self._fail_launches(*args)
            return None
        raise ValueError(f"unknown engine call {method!r}")


def run_core(config: dict, inbox_addr: str, outbox_addr: str, parent_pid: int, log_level: str = "INFO") -> None:
    """Entry point of the engine-core process."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    try:
        from moeserve.runtime.core import EngineCore

        core = EngineCore(EngineConfig(**config), progress=False)
    except Exception as e:  # noqa: BLE001 - the frontend reports it and exits
        logger.exception("engine core failed to start")
        outbox.send(pack(["startup_failed", *error_wire(e)]))
        outbox.close(linger=2000)
        return
    outbox.send(pack(["ready", core.info()]))
    try:
        CoreServer(core, inbox, outbox, parent_pid).run()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
