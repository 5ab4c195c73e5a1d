"""The engine core in its own process, and the messages it exchanges with a frontend.

The core loop owns the GPU and nothing else: it takes every message waiting on its input socket,
runs one step (which launches the next forward before reading back the previous one), and sends
one message with everything that step produced. The frontend process (HTTP, tokenizing,
detokenizing, SSE) never shares an interpreter lock with it. Adapter files are read and validated on a
worker thread (one at a time, in the order the loads arrived); the loop only registers a parsed adapter, so a
large or hostile file never stops generation. LoRA calls are answered in the order they arrived.

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
import signal
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgpack
import zmq

from moeserve.config import EngineConfig
from moeserve.engine.core import EngineCore
from moeserve.log_filter import filter_repeats
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")

# utility calls a frontend may make; the test hooks only when MOESERVE_TEST_HOOKS=1 in the core's environment
CALLS = ("list_loras", "lora_versions", "stats")
LORA_CALLS = ("load_lora", "unload_lora")  # answered in arrival order (a load waits for its file to be read)
TEST_CALLS = ("hold", "fail_next_steps", "hold_lora_reads")


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def config_to_wire(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def error_wire(e: BaseException) -> list:
    return [type(e).__name__, str(e)]


@dataclass
class LoRACall:
    """A load or unload waiting its turn; a load's file is read by `parsed` (None: nothing to wait for)."""
    call_id: int
    method: str
    args: list  # load_lora: name, path[, pinned[, replace]]; unload_lora: name
    parsed: Future | None = None

    def load_args(self) -> tuple[str, str, bool, bool]:
        name, path, *flags = self.args
        return name, path, bool(flags[0]) if flags else False, bool(flags[1]) if len(flags) > 1 else False


class CoreServer:
    """The loop around an EngineCore: messages in, one step, one message out."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.accepted: list[str] = []
        self.rejected: list[list] = []
        self.hooks = os.environ.get("MOESERVE_TEST_HOOKS") == "1"
        self.lora_calls: deque[LoRACall] = deque()
        # adapter files are read here, never on the loop: one at a time (bounded memory), in arrival order
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-lora-read")
        if core.lora_manager is not None:
            core.lora_manager.reader = self.reader  # re-reads of adapters evicted from the host cache too

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

    def _hold_reads(self, flag: str) -> None:
        """The next adapter read waits while `flag` exists (it creates flag + '.reading' when it starts)."""
        def held(manager, name, path):
            del self._parse  # one read only
            open(flag + ".reading", "w").close()
            deadline = time.monotonic() + 60
            while os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.005)
            return self._parse(manager, name, path)

        self._parse = held

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        stalled = False
        while True:
            # sleep on the socket when there is nothing to step (waking now and then to notice an orphaning),
            # and briefly when the last step could schedule nothing (waiting requests, nothing running)
            timeout = (50 if stalled else 0) if self.core.has_work() else 1000
            if self.lora_calls:
                timeout = min(timeout, 5)  # a file being read: look for its end now and then
            while poller.poll(timeout):
                if not self.handle(unpack(self.inbox.recv())):
                    return
                timeout = 0
            self.finish_lora_calls()
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
            if method in LORA_CALLS:
                self.queue_lora_call(LoRACall(call_id, method, args))
                return True
            try:
                self.reply(call_id, True, self.call(method, args))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self.reply(call_id, False, error_wire(e))
        elif kind == "shutdown":
            return False
        return True

    def reply(self, call_id: int, ok: bool, result) -> None:
        self.outbox.send(pack(["reply", call_id, ok, result]))

    # ---- adapter loads: read on the reader thread, registered here in arrival order --------------------
    def queue_lora_call(self, call: LoRACall) -> None:
        manager = self.core.lora_manager
        if call.method == "load_lora" and manager is not None:
            name, path, _, replace = call.load_args()
            try:  # a refusal that needs no file is answered at once, unless a call ahead (an unload) may change it
                if not self.lora_calls:
                    manager.check_name(name, replace)
            except Exception as e:  # noqa: BLE001
                self.reply(call.call_id, False, error_wire(e))
                return
            call.parsed = self.reader.submit(self._parse, manager, name, path)
        self.lora_calls.append(call)
        self.finish_lora_calls()

    def _parse(self, manager, name: str, path: str):
        return manager.parse(name, path)

    def finish_lora_calls(self) -> None:
        """Answer the LoRA calls at the head of the line whose files have been read."""
        while self.lora_calls and (self.lora_calls[0].parsed is None or self.lora_calls[0].parsed.done()):
            call = self.lora_calls.popleft()
            try:
                if call.method == "load_lora":
                    self._register(call)
                else:
                    self.core.unload_lora(*call.args)
                self.reply(call.call_id, True, None)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self.reply(call.call_id, False, error_wire(e))
            call.parsed = None  # the parsed tensors (or the error) go now; the registered copy lives on

    def _register(self, call: LoRACall) -> None:
        manager = self.core.lora_manager
        if manager is None:
            return self.core.load_lora(*call.load_args())  # raises: LoRA is not enabled
        name, path, pinned, replace = call.load_args()
        adapter = call.parsed.result()  # raises the reading error
        manager.register(name, path, pinned=pinned, queued=list(self.core.seqs.values()), replace=replace,
                         adapter=adapter)

    def call(self, method: str, args: list):
        if method == "lora_versions":
            return self.core.lora_manager.versions() if self.core.lora_manager is not None else {}
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
        if self.hooks and method == "hold_lora_reads":  # adapter reads wait while a flag file exists (tests)
            self._hold_reads(args[0])
            return None
        raise ValueError(f"unknown engine call {method!r}")


CORE_LOGGERS = ("moeserve",)
# what a user can get wrong (a path, a flag's value): the frontend prints one line for these, without a traceback
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


ABANDON_SIGNAL = signal.SIGUSR1  # the frontend's "stop starting": SIGTERM and SIGINT are the service manager's


class StartAbandoned(SystemExit):
    """ABANDON_SIGNAL while starting: the frontend gave up on this start (it was itself told to stop). A
    SystemExit, so that wherever it lands the process ends quietly with exit code 0."""


def _abandon_start(signum, frame):
    raise StartAbandoned()


def run_core(config: dict, inbox_addr: str, outbox_addr: str, parent_pid: int, log_level: str = "INFO") -> None:
    """Entry point of the engine-core process.

    Signals: SIGINT and SIGTERM are ignored, here and in the tensor-parallel workers started from here (which
    inherit that): Ctrl-C reaches the terminal's whole process group and systemd signals every process of the
    service, but stopping is the frontend's to run. The core stops when its frontend says so, after the requests
    in flight have drained, or when the frontend is gone (noticed within a second); ABANDON_SIGNAL ends a start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(ABANDON_SIGNAL, _abandon_start)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    core = server = None
    try:
        try:
            core = EngineCore(EngineConfig(**config), progress=False)
        except StartAbandoned:
            return
        except Exception as e:  # noqa: BLE001 - the frontend reports it and exits
            signal.signal(ABANDON_SIGNAL, signal.SIG_IGN)  # ending anyway: the signal must not raise in the exit
            if isinstance(e, USER_ERRORS):  # the message says it all; the traceback is for --log-level debug
                logger.debug("engine core failed to start", exc_info=True)
            else:
                logger.exception("engine core failed to start")
            outbox.send(pack(["startup_failed", *error_wire(e)]))
            return
        signal.signal(ABANDON_SIGNAL, signal.SIG_IGN)  # started: the frontend stops it with a message
        outbox.send(pack(["ready", core.info()]))
        server = CoreServer(core, inbox, outbox, parent_pid)
        with filter_repeats(loggers=CORE_LOGGERS):  # a failing step or request repeated: one line per interval
            server.run()
    finally:
        if server is not None:
            server.reader.shutdown(wait=False, cancel_futures=True)
        stop_workers = getattr(core.runner, "shutdown", None) if core is not None else None
        if stop_workers is not None:  # tensor parallelism: the other ranks leave the group and exit
            stop_workers()
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
