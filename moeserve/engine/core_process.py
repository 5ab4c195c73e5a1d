"""The engine core in its own process, and the messages it exchanges with a frontend.

The core loop owns the GPU and nothing else: it takes every message waiting on its input socket,
runs one step (which launches the next forward before reading back the previous one), and sends
one message with everything that step produced. The frontend process (HTTP, tokenizing,
detokenizing, SSE) never shares an interpreter lock with it. Adapter files are read and validated on a
worker thread (one at a time, in the order the loads arrived); the loop only registers a parsed adapter, so a
large or hostile file never stops generation. LoRA calls are answered in the order they arrived.

Messages: the typed records of moeserve/messages.py, msgpack-encoded by its MsgpackCodec, over two ZeroMQ
PUSH/PULL sockets (ipc://); each is handled by the handler registered for its type.

The frontend imports this module for the entry point and the wire format; the engine itself (torch, the model) is
imported by run_core, in the core's process, so the HTTP process never loads it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from moeserve.config import EngineConfig
from moeserve.errors import USER_ERRORS
from moeserve.log_filter import filter_repeats
from moeserve.messages import (CODEC, AbortRequests, AddRequest, Call, CallReply, CoreReady, FailNextSteps, Hold,
                               HoldLoRAReads, ListLoRAs, LoadLoRA, LoRAVersions, REPLY_OF, Shutdown, StartupFailed,
                               Stats, StepOutputs, UnloadLoRA)

logger = logging.getLogger("moeserve")


def config_to_wire(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@dataclass
class LoRACall:
    """A load or unload waiting its turn; a load's file is read by `parsed` (None: nothing to wait for)."""
    call: LoadLoRA | UnloadLoRA
    parsed: Future | None = None


class CoreServer:
    """The loop around an EngineCore: messages in, one step, one message out."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.accepted: list[str] = []
        self.rejected: dict[str, Exception] = {}
        self.lora_calls: deque[LoRACall] = deque()
        # what each message does; the calls answer a CallReply (LoRA calls in arrival order)
        self.handlers = {AddRequest: self.add, AbortRequests: self.abort, Shutdown: self.shutdown,
                         LoadLoRA: self.queue_lora_call, UnloadLoRA: self.queue_lora_call}
        self.calls = {ListLoRAs: lambda call: self.core.list_loras(), Stats: lambda call: self.core.stats(),
                      LoRAVersions: lambda call: (self.core.lora_manager.versions()
                                                  if self.core.lora_manager is not None else {})}
        if os.environ.get("MOESERVE_TEST_HOOKS") == "1":
            self.calls.update({Hold: self._hold, FailNextSteps: self._fail_launches, HoldLoRAReads: self._hold_reads})
        # adapter files are read here, never on the loop: one at a time (bounded memory), in arrival order
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-lora-read")
        if core.lora_manager is not None:
            core.lora_manager.reader = self.reader  # re-reads of adapters evicted from the host cache too

    def _hold(self, call: Hold) -> None:
        """Stop stepping while the flag file exists: requests pile up (tests)."""
        open(call.flag + ".held", "w").close()
        deadline = time.monotonic() + 60
        while os.path.exists(call.flag) and time.monotonic() < deadline:
            time.sleep(0.005)

    def _fail_launches(self, call: FailNextSteps) -> None:
        """The next n launches raise, as a device fault would (tests)."""
        n, message = call.n, call.message
        runner = self.core.runner
        launch = type(runner).launch.__get__(runner)
        left = [n]

        def failing(sb):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError(message)
            return launch(sb)

        runner.launch = failing

    def _hold_reads(self, call: HoldLoRAReads) -> None:
        """The next adapter read waits while the flag file exists (it creates flag + '.reading' when it starts)."""
        flag = call.flag

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
                if not self.handle(CODEC.decode(self.inbox.recv())):
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
                self.send(StepOutputs(outputs, self.accepted, self.rejected, len(sched.running), len(sched.waiting)))
                self.accepted, self.rejected = [], {}

    def send(self, msg) -> None:
        self.outbox.send(CODEC.encode(msg))

    def handle(self, msg) -> bool:
        """Do what `msg` says; False: stop the loop."""
        handler = self.handlers.get(type(msg))
        if handler is not None:
            return handler(msg) is not False
        if isinstance(msg, Call):
            self.answer(msg)
            return True
        logger.error("the engine core has no handler for %s messages; ignored", type(msg).__name__)
        return True

    def add(self, msg: AddRequest) -> None:
        try:
            self.core.add_request(msg.prompt_token_ids, msg.params, msg.lora, msg.request_id)
            self.accepted.append(msg.request_id)
        except Exception as e:  # noqa: BLE001 - travels by type; the frontend maps it to an HTTP status
            self.rejected[msg.request_id] = e

    def abort(self, msg: AbortRequests) -> None:
        for request_id in msg.request_ids:
            self.core.abort(request_id, counted=msg.counted)

    def shutdown(self, msg: Shutdown) -> bool:
        return False

    def answer(self, call: Call) -> None:
        """Run a call now and reply (an unknown or disabled one: ValueError)."""
        try:
            run = self.calls.get(type(call))
            if run is None:
                raise ValueError(f"unknown engine call {type(call).__name__}")
            self.reply(call, run(call))
        except Exception as e:  # noqa: BLE001 - handed to the caller, by type
            self.reply(call, error=e)

    def reply(self, call: Call, result=None, error: Exception | None = None) -> None:
        self.send(REPLY_OF.get(type(call), CallReply)(call.call_id, result, error))

    # ---- adapter loads: read on the reader thread, registered here in arrival order --------------------
    def queue_lora_call(self, call: LoadLoRA | UnloadLoRA) -> None:
        manager = self.core.lora_manager
        waiting = LoRACall(call)
        if isinstance(call, LoadLoRA) and manager is not None:
            try:  # a refusal that needs no file is answered at once, unless a call ahead (an unload) may change it
                if not self.lora_calls:
                    manager.check_name(call.name, call.replace)
            except Exception as e:  # noqa: BLE001
                self.reply(call, error=e)
                return
            waiting.parsed = self.reader.submit(self._parse, manager, call.name, call.path)
        self.lora_calls.append(waiting)
        self.finish_lora_calls()

    def _parse(self, manager, name: str, path: str):
        return manager.parse(name, path)

    def finish_lora_calls(self) -> None:
        """Answer the LoRA calls at the head of the line whose files have been read."""
        while self.lora_calls and (self.lora_calls[0].parsed is None or self.lora_calls[0].parsed.done()):
            waiting = self.lora_calls.popleft()
            try:
                if isinstance(waiting.call, LoadLoRA):
                    self._register(waiting)
                else:
                    self.core.unload_lora(waiting.call.name)
                self.reply(waiting.call)
            except Exception as e:  # noqa: BLE001 - handed to the caller, by type
                self.reply(waiting.call, error=e)
            waiting.parsed = None  # the parsed tensors (or the error) go now; the registered copy lives on

    def _register(self, waiting: LoRACall) -> None:
        manager, call = self.core.lora_manager, waiting.call
        if manager is None:
            return self.core.load_lora(call.name, call.path, call.pinned, call.replace)  # raises: LoRA is not enabled
        adapter = waiting.parsed.result()  # raises the reading error
        manager.register(call.name, call.path, pinned=call.pinned, queued=list(self.core.seqs.values()),
                         replace=call.replace, adapter=adapter)


CORE_LOGGERS = ("moeserve",)


ABANDON_SIGNAL = signal.SIGUSR1  # the frontend's "stop starting": SIGTERM and SIGINT are the service manager's


class StartAbandoned(SystemExit):
    """ABANDON_SIGNAL while starting: the frontend gave up on this start (it was itself told to stop). A
    SystemExit, so that wherever it lands the process ends quietly with exit code 0."""


def _abandon_start(signum, frame):
    raise StartAbandoned()


def run_core(config: dict, inbox_addr: str, outbox_addr: str, parent_pid: int, log_level: str = "INFO",
             name: str = "core") -> None:
    """Entry point of the engine-core process (see serve_core). A core that served and was shut down leaves
    without the interpreter's teardown (~0.6 s of CPU on a CPU engine): its sockets are closed and its
    tensor-parallel ranks reaped by then, and nothing else of it needs an orderly exit."""
    if serve_core(config, inbox_addr, outbox_addr, parent_pid, log_level, name):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def serve_core(config: dict, inbox_addr: str, outbox_addr: str, parent_pid: int, log_level: str = "INFO",
               name: str = "core") -> bool:
    """The engine core's life: start, serve, stop; True once it served and was shut down cleanly.

    Signals: SIGINT and SIGTERM are ignored, here and in the tensor-parallel workers started from here (which
    inherit that): Ctrl-C reaches the terminal's whole process group and systemd signals every process of the
    service, but stopping is the frontend's to run. The core stops when its frontend says so, after the requests
    in flight have drained, or when the frontend is gone (noticed within a second); ABANDON_SIGNAL ends a start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(ABANDON_SIGNAL, _abandon_start)
    # `name` tells the cores of a data-parallel server apart in the log ("core 0", "core 1")
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s [{name}]: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    core = server = None
    served = False
    try:
        try:
            from moeserve.engine.core import EngineCore  # torch and the model code: in this process only

            core = EngineCore(EngineConfig(**config), progress=False)
        except StartAbandoned:
            return False
        except Exception as e:  # noqa: BLE001 - the frontend reports it and exits
            signal.signal(ABANDON_SIGNAL, signal.SIG_IGN)  # ending anyway: the signal must not raise in the exit
            if isinstance(e, USER_ERRORS):  # the frontend prints one line; the traceback is for --log-level debug
                logger.debug("engine core failed to start", exc_info=True)
            else:
                logger.exception("engine core failed to start")
            outbox.send(CODEC.encode(StartupFailed(e)))
            return False
        signal.signal(ABANDON_SIGNAL, signal.SIG_IGN)  # started: the frontend stops it with a message
        outbox.send(CODEC.encode(CoreReady(core.info())))
        server = CoreServer(core, inbox, outbox, parent_pid)
        with filter_repeats(loggers=CORE_LOGGERS):  # a failing step or request repeated: one line per interval
            server.run()
        served = True
    finally:
        if server is not None:
            server.reader.shutdown(wait=False, cancel_futures=True)
        stop_workers = getattr(core.runner, "shutdown", None) if core is not None else None
        if stop_workers is not None:  # tensor parallelism: the other ranks leave the group and exit
            stop_workers()
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
    return served
