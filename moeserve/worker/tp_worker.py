"""A tensor-parallel worker: one process per rank other than 0, started by rank 0 (worker/parallel_runner.py).

It holds its rank's shard of the model, its KV cache, LoRA slot pool and graphs, and does what rank 0's
messages say, in order: run a step's plan (the same forward, logits and token broadcast as rank 0),
load or clear an adapter slot, size the KV cache, capture graphs. It never schedules or samples. It exits
when rank 0 says so or when rank 0's end of the pipe closes (rank 0 is gone).
"""
from __future__ import annotations

import logging
import pickle
import sys
import traceback

import torch

from moeserve.distributed.parallel_state import destroy_parallel_state, init_parallel_state, rendezvous_store
from moeserve.distributed.sharding import TensorSharding, rank_spec, shard_adapter
from moeserve.lora.slot_pool import LoRASlotPool, lora_slot_state
from moeserve.models.loader import load_model
from moeserve.worker.model_runner import ModelRunner
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

    def load(self) -> None:
        cfg = self.config
        model = load_model(self.model_dir, self.spec, cfg.exec_options().on_device(self.device),
                           load_format=cfg.load_format, seed=cfg.seed, tp=self.tp)
        self.runner = ModelRunner(cfg, self.rank_spec, self.model_dir, model=model)

    # ---- messages ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, plan) -> None:
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

    def lora_pool(self, targets, max_loras: int, max_rank: int, separate_gate_up: bool) -> None:
        self.runner.lora_pool = LoRASlotPool(self.spec, self.runner.model, max_loras, max_rank, set(targets),
                                             self.device, self.config.torch_dtype, separate_gate_up=separate_gate_up)

    def lora_load(self, slot: int, adapter) -> None:
        self.runner.lora_pool.load(slot, shard_adapter(adapter, self.sharding))

    def capture(self) -> None:
        self.runner.capture_graphs()

    def lora_slots(self) -> list[tuple[int, bool]]:
        return lora_slot_state(self.runner.lora_pool)

    def replay_counts(self) -> dict[str, int]:
        gr = self.runner.graph_runner
        return gr.replay_counts() if gr is not None else {}


def worker_main(rank: int, world_size: int, store_port: int, config, spec, model_dir, conn) -> None:
    """Process entry point. Replies (None = done, else an error text) go back for the messages rank 0 waits on."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [tp rank {rank}]: %(message)s")

    def reply(value) -> None:
        conn.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def attempt(fn, *args):
        try:
            fn(*args)
            return None
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which decides
            logger.error("%s", traceback.format_exc())
            return f"{type(e).__name__}: {e}"

    worker = Worker(rank, world_size, store_port, config, spec, model_dir)
    error = attempt(worker.load)
    reply(error)
    if error is not None:
        sys.exit(1)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone (an engine without an explicit shutdown ends so too)
            logger.info("rank 0 closed the pipe; tensor-parallel rank %d exiting", rank)
            return
        kind = msg[0]
        if kind == "step":
            worker.step(msg[1])  # a failure here breaks the collectives: rank 0 notices and names this rank
        elif kind == "lora_load":
            reply(attempt(worker.lora_load, *msg[1:]))
        elif kind == "lora_clear":
            worker.runner.lora_pool.clear(msg[1])
        elif kind == "kv_cache":
            try:
                reply(worker.runner.allocate_kv_cache(msg[1]))
            except Exception as e:  # noqa: BLE001
                reply(f"{type(e).__name__}: {e}")
        elif kind == "kv_cache_final":
            if msg[1] != worker.runner.model.kv_caches[0][0].shape[0]:
                worker.runner.model.kv_caches = []
                if worker.device.type == "cuda":
                    torch.cuda.empty_cache()
                reply(attempt(worker.runner.allocate_kv_cache, msg[1]))
            else:
                reply(None)
        elif kind == "lora_pool":
            reply(attempt(worker.lora_pool, *msg[1:]))
        elif kind == "capture":
            reply(attempt(worker.capture))
        elif kind == "replay_counts":
            reply(worker.replay_counts())
        elif kind == "lora_slots":
            reply(worker.lora_slots())
        elif kind == "all_reduce_backend":
            reply(worker.tp.all_reduce_backend)
        elif kind == "shutdown":
            release_graphs(worker.runner)  # before the teardown, which waits for graphs holding collectives
            destroy_parallel_state(worker.tp)  # the symmetric buffer, then the process group (as rank 0 does)
            return
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")
