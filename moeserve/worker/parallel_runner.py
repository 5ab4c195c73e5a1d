"""Tensor parallelism on the engine side: rank 0's model runner and the plan every rank runs per step.

The engine core (scheduler, LoRA manager, sampling) stays in one process, rank 0. It starts one worker
process per other rank (torch.multiprocessing, spawn; worker/tp_worker.py) and talks to each over a pipe.
Each step rank 0 decides everything on the host once — the batch, eager or graph and the GraphKey, which
rows need logits — and sends that StepPlan to every worker before running it itself; so every rank runs
the same forward and replays the same GraphKey (docs/architecture.md, invariants 3 and 10). Only activations travel
through collectives: the all-reduces inside the forward, the all-gather of logits, and the broadcast of
rank 0's sampled tokens (the input of the next step's pending rows).

A rank that dies or stops answering stops the engine with a RankFailure naming it: worker processes are
checked before every step, a failed or timed-out collective is mapped to the rank that caused it, and
every worker is stopped with it.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moeserve.config import EngineConfig
from moeserve.distributed.parallel_state import (ParallelState, abort_parallel_state, destroy_parallel_state,
                                                 init_parallel_state, rendezvous_store)
from moeserve.distributed.sharding import TensorSharding, rank_spec, shard_adapter
from moeserve.errors import LoRAAdapterError, RankFailure
from moeserve.model_spec import ModelSpec
from moeserve.models.loader import load_model
from moeserve.worker.model_runner import InFlightStep, ModelRunner, StepResult
from moeserve.worker.sequence import ScheduledBatch
from moeserve.worker import tp_messages
from moeserve.worker.tp_messages import (AllocateKVCache, CaptureGraphs, ClearLoRASlot, CreateLoRAPool,
                                         GetAllReduceBackend, GetLoRASlots, GetReplayCounts, LoadLoRASlot,
                                         ResizeKVCache, StepPlan, StopWorker, WorkerReply)
from moeserve.worker.tp_step import batch_to_wire, release_graphs, run_forward, symm_mem_buffer
from moeserve.worker.tp_worker import worker_main

logger = logging.getLogger("moeserve")


# ---- rank 0 ---------------------------------------------------------------------------------------------

@contextmanager
def _signals_held():
    """Python signal handlers deferred while a worker starts: one that raises (the engine core's start-abandon
    signal) would otherwise cut the child's start-up data short mid-write (the child dies printing a traceback) or
    leave a started worker untracked. Deferred signals are raised again on leaving, to the handlers they had. (Not
    a thread signal mask: a signal sent to the process goes to any thread that does not block it, and Python runs
    its handler in the main thread at once.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    handlers = {}
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler):
            handlers[sig] = handler
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sig in pending:
            signal.raise_signal(sig)


@contextmanager
def _children_allowed():
    """Under the server the engine core is a daemonic process, and multiprocessing refuses children of daemonic
    processes (it could not clean them up at exit). Workers exit by themselves when rank 0's end of their pipe
    closes, so rank 0 may start them from one: lift the flag for the start only."""
    me = multiprocessing.current_process()
    daemon = me._config.get("daemon")
    me._config["daemon"] = False
    try:
        yield
    finally:
        me._config["daemon"] = daemon


@dataclass
class _Worker:
    rank: int
    proc: "torch.multiprocessing.Process"
    conn: "torch.multiprocessing.connection.Connection"


class ParallelModelRunner(ModelRunner):
    """Rank 0's ModelRunner under tensor parallelism: it holds rank 0's shard, starts the other ranks, and
    sends them every step's plan (and every adapter load/clear, KV-cache size and graph capture)."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model_dir: str | None, progress: bool = False):
        n = config.tensor_parallel_size
        ep = config.enable_expert_parallel
        self.sharding = TensorSharding(spec, 0, n, ep)  # refuses a model that does not split over n ranks, first
        self.timeout_s = config.dist_timeout
        self.world_size = n
        self.workers: list[_Worker] = []
        self.failure: RankFailure | None = None
        self.tp: ParallelState | None = None
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        store = rendezvous_store(0, n, is_master=True)
        ctx = torch.multiprocessing.get_context("spawn")
        try:
            with _children_allowed():
                self._start_workers(ctx, n, store.port, config, spec, model_dir)
            self.tp = self._join_group(store, device, symm_mem_buffer(config, spec))
            model = load_model(model_dir, spec, config.exec_options().on_device(device), progress=progress,
                               load_format=config.load_format, seed=config.seed, tp=self.tp)
            # self.spec is then this rank's shapes, which size its KV cache; the core keeps the whole model's
            super().__init__(config, rank_spec(spec, n, ep), model_dir, model=model)
            self._expect_ok("loading its shard of the model")
        except BaseException:
            self.shutdown()
            raise
        how = " (--disable-custom-all-reduce)" if config.disable_custom_all_reduce else ""
        logger.info("tensor parallel: %d ranks (%s), all-reduce: %s%s%s", n,
                    "nccl" if device.type == "cuda" else "gloo", self.tp.all_reduce_backend, how,
                    ", routed experts expert-parallel" if ep else "")

    def _start_workers(self, ctx, n: int, store_port: int, config: EngineConfig, spec: ModelSpec, model_dir) -> None:
        for rank in range(1, n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"moeserve-tp-rank{rank}", daemon=True,
                               args=(rank, n, store_port, config, spec, model_dir, child))
            with _signals_held():
                proc.start()
                child.close()
                self.workers.append(_Worker(rank, proc, parent))

    def _join_group(self, store, device: torch.device, symm_mem: tuple[int, torch.dtype] | None) -> ParallelState:
        """Join the process group (and set up the symmetric all-reduce buffer with the other ranks), watching the
        workers meanwhile: one that dies while starting is named at once instead of after the rendezvous timeout."""
        result: dict = {}

        def join():
            try:
                if device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(device)
                result["tp"] = init_parallel_state(0, self.world_size, store, device, self.timeout_s,
                                                   self.sharding.expert_parallel, symm_mem)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                result["error"] = e

        t = threading.Thread(target=join, name="moeserve-tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            self._check_workers()
        if "error" in result:
            raise result["error"]
        return result["tp"]

    # ---- talking to the workers ------------------------------------------------------------------
    def send_to_workers(self, msg) -> None:
        """Send a message of worker/tp_messages.py to every worker."""
        self._check_workers()
        data = tp_messages.encode(msg)
        for w in self.workers:
            try:
                w.conn.send_bytes(data)
            except OSError:
                self._check_workers(wait_s=1.0)
                self._fail(f"tensor-parallel rank {w.rank} stopped reading its messages")

    def worker_replies(self, what: str) -> dict[int, WorkerReply]:
        """One reply from every worker, each waited for at most timeout_s while its process lives."""
        out = {}
        for w in self.workers:
            deadline = time.monotonic() + self.timeout_s
            while not w.conn.poll(0.05):
                self._check_workers()
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel rank {w.rank} did not answer within {self.timeout_s} s while "
                               f"{what}")
            try:
                out[w.rank] = tp_messages.decode(w.conn.recv_bytes())
            except (EOFError, OSError):
                self._check_workers(wait_s=1.0)
                self._fail(f"tensor-parallel rank {w.rank} closed its pipe while {what}")
        return out

    def _expect_ok(self, what: str) -> dict[int, object]:
        """Every worker's reply value; the first failed rank's error raised again, of its own class, naming the rank."""
        replies = self.worker_replies(what)
        for rank, reply in sorted(replies.items()):
            if reply.error is not None:
                raise reply.raised_on(rank, what)
        return {rank: reply.value for rank, reply in replies.items()}

    def _check_workers(self, wait_s: float = 0.0) -> None:
        """Raise RankFailure if a worker process has exited (`wait_s`: give a dying one that long to exit)."""
        if self.failure is not None:
            raise self.failure
        for w in self.workers:
            if wait_s:
                w.proc.join(wait_s)
            code = w.proc.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self._fail(f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) {how}")

    def _fail(self, message: str):
        """The engine cannot go on: stop every worker and raise (now and on every later call)."""
        if self.failure is None:
            logger.error("%s; stopping the engine", message)
            self.failure = RankFailure(message + "; the engine has stopped")
            for w in self.workers:
                if w.proc.is_alive():
                    w.proc.kill()
        raise self.failure

    @contextmanager
    def _collectives(self, what: str):
        """Map a failed or timed-out collective to the rank behind it."""
        t0 = time.monotonic()
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as e:  # torch.distributed raises DistBackendError / RuntimeError
            self._check_workers(wait_s=1.0)  # a dead rank names itself
            alive = [w.rank for w in self.workers]
            self._fail(f"a collective of {what} failed on rank 0 after {time.monotonic() - t0:.1f} s "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); tensor-parallel "
                       f"rank(s) {alive} are alive but did not take part (hung?)")

    # ---- engine hooks ----------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Every rank sizes its cache; all use the smallest count (the scheduler hands out one block table)."""
        self.send_to_workers(AllocateKVCache(num_blocks))
        mine = super().allocate_kv_cache(num_blocks)
        counts = self._expect_ok("allocating its KV cache")
        least = min(mine, *counts.values())
        self.send_to_workers(ResizeKVCache(least))
        self.resize_kv_cache(least)
        self._expect_ok("resizing its KV cache")
        return least

    def shard_lora_pool(self, pool):
        """Wrap rank 0's slot pool so that every load and clear also happens on the other ranks."""
        self.send_to_workers(CreateLoRAPool(sorted(pool.targets), pool.max_loras, pool.max_rank, pool.separate_gate_up))
        self._expect_ok("allocating its LoRA slot pool")
        return ShardedLoRAPool(pool, self)

    def capture_graphs(self, progress: bool = False) -> None:
        self.send_to_workers(CaptureGraphs())  # every rank captures the same keys in the same order (collectives)
        with self._collectives("graph capture"):
            super().capture_graphs(progress)
        self._expect_ok("capturing its graphs")

    def worker_replay_counts(self) -> dict[int, dict[str, int]]:
        """Each worker's graph replays per GraphKey (tests compare them with rank 0's)."""
        self.send_to_workers(GetReplayCounts())
        return self._expect_ok("reporting its replay counts")

    def worker_all_reduce_backends(self) -> dict[int, str]:
        """Each worker's all-reduce backend (every rank must run the same one)."""
        self.send_to_workers(GetAllReduceBackend())
        return self._expect_ok("reporting its all-reduce backend")

    def worker_lora_slots(self) -> dict[int, list[tuple[int, bool]]]:
        """Each worker's LoRA slots as (rank, holds any nonzero weight) (tests check loads and rollbacks)."""
        self.send_to_workers(GetLoRASlots())
        return self._expect_ok("reporting its LoRA slots")

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch) -> InFlightStep:
        graphed = self.graph_runner is not None and self.graph_runner.can_run(sb)
        batch = self.prepare(sb, on_host=True)
        key = self.graph_runner.key_for(batch, [s.lora_slot for s in sb.seqs]) if graphed else None
        rows, _, prompt_rows = self._logit_rows(sb)
        pending = any(s.num_pending for s in sb.seqs)
        self.send_to_workers(StepPlan(batch_to_wire(batch), key, pending, rows,
                                      [(first, count) for _, first, count in prompt_rows]))
        with self._collectives("a forward step"):
            hidden = run_forward(self, batch, key, self.prev_tokens if pending else None)
            step = self._sample(sb, hidden)
            if rows:  # the other ranks' inputs for the next step's pending rows
                self.tp.broadcast(self.prev_tokens, src=0)
        return step

    def collect(self, step: InFlightStep) -> StepResult:
        if step.done is not None:  # on CUDA: wait for the step, but not past a dead or hung rank
            deadline = time.monotonic() + self.timeout_s
            next_check = 0.0
            while not step.done.query():
                now = time.monotonic()
                if now > next_check:
                    self._check_workers()
                    next_check = now + 0.1
                if now > deadline:
                    self._fail(f"a step did not finish within {self.timeout_s} s; tensor-parallel rank(s) "
                               f"{[w.rank for w in self.workers]} are alive (one is hung?)")
                time.sleep(50e-6)
        return super().collect(step)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (a later engine in this process can start anew).
        Healthy: every rank releases its graphs, then its symmetric buffer, then leaves the group; rank 0 does so
        while the workers do (NCCL's teardown is collective, so rank 0 waiting for the workers to exit first would
        deadlock with workers waiting in their teardown for rank 0).
        After a failure a rank is gone: the group is aborted at once, without waiting on the stream (it may hold a
        collective that waits for the dead rank) or on a collective teardown that cannot complete."""
        healthy = self.failure is None
        try:
            if healthy and self.workers:
                try:
                    self.send_to_workers(StopWorker())
                except RankFailure:
                    healthy = False
            if self.tp is not None:
                if healthy:
                    release_graphs(self)
                    self._leave_group()
                else:
                    abort_parallel_state()
                self.tp = None
        finally:
            for w in self.workers:
                w.proc.join(5.0)
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(5.0)
                w.conn.close()
            self.workers = []

    def _leave_group(self) -> None:
        """Free the symmetric buffer and destroy the process group, watched: it ends when every rank has left; a
        worker that exits with an error or dies meanwhile, or the timeout, turns it into an abort."""
        t = threading.Thread(target=destroy_parallel_state, args=(self.tp,), name="moeserve-tp-leave", daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive():
            t.join(0.1)
            failed = [w.rank for w in self.workers if w.proc.exitcode not in (None, 0)]
            if t.is_alive() and (failed or time.monotonic() > deadline):
                logger.warning("tensor-parallel process group teardown did not finish (%s); aborting it",
                               f"rank(s) {failed} exited with an error" if failed else f"{self.timeout_s} s passed")
                abort_parallel_state()
                return


class ShardedLoRAPool:
    """Rank 0's slot pool as the LoRA manager sees it: a load or clear happens on every rank, each copying its
    slice of the adapter (distributed/sharding.py), or on none — a load that fails anywhere is cleared
    everywhere and raises. Everything else is rank 0's pool (slot ranks, sizes, check_fits)."""

    def __init__(self, pool, runner: ParallelModelRunner):
        self.pool, self.runner = pool, runner

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def load(self, slot: int, adapter) -> None:
        self.runner.send_to_workers(LoadLoRASlot(slot, adapter))
        errors = {}
        try:
            self.pool.load(slot, shard_adapter(adapter, self.runner.sharding))
        except Exception as e:  # noqa: BLE001 - rolled back below, on every rank
            errors[0] = f"{type(e).__name__}: {e}"
        replies = self.runner.worker_replies("loading an adapter")
        errors.update({r: "{}: {}".format(*reply.error) for r, reply in replies.items() if reply.error is not None})
        if errors:
            self.clear(slot)
            rank, err = min(errors.items())
            raise LoRAAdapterError(f"adapter {adapter.name!r} could not be loaded on tensor-parallel rank {rank} "
                                   f"({err}); slot {slot} was cleared on every rank")

    def clear(self, slot: int) -> None:
        self.runner.send_to_workers(ClearLoRASlot(slot))
        self.pool.clear(slot)
