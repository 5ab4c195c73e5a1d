"""A tensor-parallel worker: one process per rank other than 0, started by rank 0 (worker/parallel_runner.py).

It holds its rank's shard of the model, its KV cache, LoRA slot pool and graphs, and does what rank 0's
messages say, in order: run a step's plan (the same forward, logits and token broadcast as rank 0),
load or clear an adapter slot, size the KV cache, capture graphs. It never schedules or samples. It exits
when rank 0 says so or when rank 0's end of the pipe closes (rank 0 is gone).
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

import torch

from moeserve.distributed.parallel_state import destroy_parallel_state, init_parallel_state, rendezvous_store
from moeserve.distributed.sharding import TensorSharding, rank_spec, shard_adapter
from moeserve.lora.slot_pool import LoRASlotPool, lora_slot_state
from moeserve.models.loader import load_model
from moeserve.worker.model_runner import ModelRunner
from moeserve.worker import tp_messages
from moeserve.worker.tp_messages import (AllocateKVCache, CaptureGraphs, ClearLoRASlot, CreateLoRAPool,
                                         GetAllReduceBackend, GetLoRASlots, GetReplayCounts, LoadLoRASlot,
                                         ResizeKVCache, StepPlan, StopWorker, WorkerReply)
from moeserve.worker.tp_step import batch_from_wire, release_graphs, run_forward, symm_mem_buffer

logger = logging.getLogger("moeserve")


class Worker:
    def __init__(self, rank: int, world_size: int, store_port: int, config, spec, model_dir: str | None):
        if config.device.startswith("cuda"):
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            config = config.on_device(str(device))
        else:
            device = torch.device("cpu")
        self.config, self.spec, self.model_dir, self.device = config, spec, model_dir, device
        store = rendezvous_store(store_port, world_size, is_master=False)
        ep = config.enable_expert_parallel
        self.tp = init_parallel_state(rank, world_size, store, device, config.dist_timeout, ep,
                                      symm_mem_buffer(config, spec))
        self.sharding = TensorSharding(spec, rank, world_size, ep)
        self.rank_spec = rank_spec(spec, world_size, ep)
        self.runner = None
        # what each message of rank 0's does (worker/tp_messages.py)
        self.handlers = {StepPlan: self.step, AllocateKVCache: self.allocate_kv_cache,
                         ResizeKVCache: self.resize_kv_cache, CreateLoRAPool: self.lora_pool,
                         LoadLoRASlot: self.lora_load, ClearLoRASlot: self.lora_clear, CaptureGraphs: self.capture,
                         GetReplayCounts: self.replay_counts, GetLoRASlots: self.lora_slots,
                         GetAllReduceBackend: lambda msg: self.tp.all_reduce_backend, StopWorker: self.stop}

    def load(self) -> None:
        cfg = self.config
        model = load_model(self.model_dir, self.spec, cfg.exec_options().on_device(self.device),
                           load_format=cfg.load_format, seed=cfg.seed, tp=self.tp)
        self.runner = ModelRunner(cfg, self.rank_spec, self.model_dir, model=model)

    # ---- messages ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, plan: StepPlan) -> None:
        runner = self.runner
        pool = runner.lora_pool
        batch = batch_from_wire(plan.batch, pool.slot_ranks if pool is not None else None)
        hidden = run_forward(runner, batch, plan.key, runner.prev_tokens if plan.pending else None)
        # the same logits all-gathers as rank 0's sampling, in the same order
        rows = plan.sample_rows
        if rows:
            picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
            runner.model.compute_logits(picked)
        for first, count in plan.prompt_rows:
            runner.model.compute_logits(hidden[first:first + count])
        if rows:
            tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            runner.prev_tokens = self.tp.broadcast(tokens, src=0)

    def allocate_kv_cache(self, msg: AllocateKVCache) -> int:
        return self.runner.allocate_kv_cache(msg.num_blocks)

    def resize_kv_cache(self, msg: ResizeKVCache) -> None:
        self.runner.resize_kv_cache(msg.num_blocks)

    def lora_pool(self, msg: CreateLoRAPool) -> None:
        self.runner.lora_pool = LoRASlotPool(self.spec, self.runner.model, msg.max_loras, msg.max_rank,
                                             set(msg.targets), self.device, self.config.torch_dtype,
                                             separate_gate_up=msg.separate_gate_up)

    def lora_load(self, msg: LoadLoRASlot) -> None:
        self.runner.lora_pool.load(msg.slot, shard_adapter(msg.adapter, self.sharding))

    def lora_clear(self, msg: ClearLoRASlot) -> None:
        self.runner.lora_pool.clear(msg.slot)

    def capture(self, msg: CaptureGraphs) -> None:
        self.runner.capture_graphs()

    def lora_slots(self, msg: GetLoRASlots) -> list[tuple[int, bool]]:
        return lora_slot_state(self.runner.lora_pool)

    def replay_counts(self, msg: GetReplayCounts) -> dict[str, int]:
        gr = self.runner.graph_runner
        return gr.replay_counts() if gr is not None else {}

    def stop(self, msg: StopWorker) -> None:
        release_graphs(self.runner)  # before the teardown, which waits for graphs holding collectives
        destroy_parallel_state(self.tp)  # the symmetric buffer, then the process group (as rank 0 does)


def worker_main(rank: int, world_size: int, store_port: int, config, spec, model_dir, conn) -> None:
    """Process entry point: load this rank's shard, then run rank 0's messages in order, replying to those rank 0
    waits on (WorkerReply: the value, or the error by type)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [tp rank {rank}]: %(message)s")

    def attempt(fn, *args) -> WorkerReply:
        try:
            return WorkerReply(fn(*args))
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which decides
            logger.error("%s", traceback.format_exc())
            return WorkerReply.failed(e)

    worker = Worker(rank, world_size, store_port, config, spec, model_dir)
    loaded = attempt(worker.load)
    conn.send_bytes(tp_messages.encode(loaded))
    if loaded.error is not None:
        sys.exit(1)
    while True:
        try:
            msg = tp_messages.decode(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone (an engine without an explicit shutdown ends so too)
            logger.info("rank 0 closed the pipe; tensor-parallel rank %d exiting", rank)
            return
        handler = worker.handlers[type(msg)]
        if msg.answered:
            conn.send_bytes(tp_messages.encode(attempt(handler, msg)))
        else:  # a failure here (a step, a clear) ends this rank: rank 0 notices and names it
            handler(msg)
        if isinstance(msg, StopWorker):  # the group is left: exit without the interpreter's teardown (as
            sys.stdout.flush()  # bench/tp_profile.py's ranks do), which took ~0.7 s of a CPU rank's stop
            sys.stderr.flush()
            os._exit(0)
