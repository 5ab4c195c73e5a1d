"""Per-layer kernel budget of a decode layer under tensor / expert parallelism (`bench tp_decode --profile`).

Each rank builds its shard of the random-weight model as an engine worker does (worker/tp_worker.py), and then all
ranks run layer_profile's regions in lockstep, rank 0 reporting: a region holding a collective (the all-reduce after
attention and after the MoE, OLMoE's sharded q/k norms) only runs when every rank runs it, so every rank captures
and replays the same graphs in the same order. Rank 0 is the calling process, the others are started here
(torch.multiprocessing, spawn). `bench tp_decode` calls this in a fresh interpreter per setting, so the ranks set
up the symmetric-memory all-reduce anew (parallel_state serves the first tensor-parallel group of a process only).

The layer's input is the embedding of a distinct random token per row, as `bench tp_decode` times decode: identical
rows would all route to the same experts and read a fraction of the expert bytes real traffic reads.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

from moeserve.bench import layer_profile
from moeserve.bench.decode import PROMPT
from moeserve.config import EngineConfig
from moeserve.model_spec import ModelSpec
from moeserve.worker.model_runner import ModelRunner
from moeserve.worker.sequence import ScheduledBatch
from moeserve.worker.sequence import Sequence
from moeserve.sampling_params import SamplingParams

CPU_BANDWIDTH = 1e11  # bytes/s: a nominal floor on CPU, where only the tests run the budget (gloo, wall clock)


def engine_config(model_dir: str, tp: int, ep: bool, all_reduce: str, batches: list[int], device: str,
                  dist_timeout: int = 600) -> EngineConfig:
    """The config of the timed engine, base model (LoRA off), resolved as the engine core resolves it."""
    max_len = PROMPT + 16
    blocks = max(batches) * -(-max_len // 16) + 2
    return EngineConfig(model=model_dir, load_format="dummy", device=device, tensor_parallel_size=tp,
                        enable_expert_parallel=ep, max_model_len=max_len, max_num_seqs=max(batches), block_size=16,
                        num_kv_blocks=blocks, disable_custom_all_reduce=all_reduce == "nccl",
                        dist_timeout=dist_timeout).resolve()


def wall_time_us(fns) -> float:
    """µs per call of the fns run once each, by the wall clock (CPU: no graphs)."""
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


def setup_rank(rank: int, config: EngineConfig, model_dir: str, store_port: int):
    """This rank's model runner (its shard, a KV cache for the batches) and parallel state (None on one rank)."""
    spec = ModelSpec.from_model_dir(model_dir)
    if config.tensor_parallel_size == 1:
        runner, tp = ModelRunner(config, spec, model_dir), None
    else:
        from moeserve.worker.tp_worker import Worker

        worker = Worker(rank, config.tensor_parallel_size, store_port, config, spec, model_dir)  # joins the group
        worker.load()
        runner, tp = worker.runner, worker.tp
    runner.allocate_kv_cache(config.num_kv_blocks)
    return runner, tp


def decode_inputs(runner: ModelRunner, B: int) -> tuple:
    """A decode batch of B rows at context PROMPT, each row a distinct random token (the same on every rank), and
    the layer input: those tokens' embeddings (vocabulary-split under tensor parallelism: a collective)."""
    model = runner.model
    g = torch.Generator().manual_seed(B)
    per_seq = -(-runner.config.max_model_len // runner.block_size)
    seqs = []
    for i in range(B):
        prompt = torch.randint(3, model.spec.vocab_size, (PROMPT,), generator=g).tolist()
        s = Sequence(f"b{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0))
        s.block_table = [1 + i * per_seq + j for j in range(per_seq)]
        s.num_computed_tokens = PROMPT - 1
        seqs.append(s)
    batch = runner.prepare(ScheduledBatch(seqs, [1] * B, is_decode=True))
    if model.tp is not None:
        from moeserve.layers.parallel import vocab_parallel_embedding

        x = vocab_parallel_embedding(batch.input_ids, model.embed_tokens, model.vocab_start, model.tp)
    else:
        x = F.embedding(batch.input_ids, model.embed_tokens)
    return batch, x


def rank_budgets(rank: int, store_port: int, config: EngineConfig, model_dir: str, batches: list[int]) -> dict:
    """Every rank: the layer budget at each batch size (layer_profile.layer_budget, in lockstep with the others)."""
    runner, tp = setup_rank(rank, config, model_dir, store_port)
    try:
        if runner.device.type == "cuda":
            from moeserve.bench.common import bandwidths, graph_time_us

            bw, timer = bandwidths()[1], graph_time_us  # this rank's own read ceiling
        else:
            bw, timer = CPU_BANDWIDTH, wall_time_us
        budgets = {}
        with torch.inference_mode():
            for B in batches:
                batch, x = decode_inputs(runner, B)
                budgets[B] = layer_profile.layer_budget(runner.model, runner.kv_caches, batch, x, PROMPT, bw, timer)
        return {"all_reduce": tp.all_reduce_backend if tp is not None else "-", "read_bandwidth": bw,
                "budgets": budgets}
    finally:
        release(runner, tp)


def release(runner: ModelRunner, tp) -> None:
    """Leave the group as the engine's ranks do: graphs and buffers first, then the symmetric buffer and group."""
    if tp is not None:
        from moeserve.distributed.parallel_state import destroy_parallel_state
        from moeserve.worker.tp_step import release_graphs

        release_graphs(runner)
        destroy_parallel_state(tp)


def _rank_main(rank: int, fn: Callable, store_port: int, args: tuple) -> None:
    """A spawned rank. It leaves without the interpreter's teardown once done (its group is left already): a TP=2
    process once aborted in its exit's garbage collection, and rank 0 reads a slow exit as a failed rank."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [profile rank {rank}]: %(message)s")
    code = 0
    try:
        fn(rank, store_port, *args)
    except BaseException:  # noqa: BLE001 - its exit code tells rank 0
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn: Callable, world_size: int, *args, join_s: float = 120.0):
    """fn(rank, store_port, *args) on every rank — rank 0 in this process (a thread, watched), the others spawned —
    and rank 0's result. A rank that exits with an error is named at once, not after rank 0's collectives time
    out; when rank 0 fails, the others (waiting in a collective) are killed."""
    if world_size == 1:
        return fn(0, 0, *args)
    from moeserve.distributed.parallel_state import rendezvous_store

    store = rendezvous_store(0, world_size, is_master=True)  # rank 0 serves it; kept alive while ranks meet
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, fn, store.port, args), name=f"moeserve-profile-rank{rank}",
                         daemon=True) for rank in range(1, world_size)]
    for p in procs:
        p.start()
    outcome: dict = {}

    def rank0():
        try:
            outcome["result"] = fn(0, store.port, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            outcome["error"] = e

    thread = threading.Thread(target=rank0, name="moeserve-profile-rank0", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs, start=1) if p.exitcode not in (None, 0)]
            if failed and thread.is_alive():
                raise RuntimeError("profile " + ", ".join(f"rank {r} exited with code {c}" for r, c in failed)
                                   + " while rank 0 was running")
        if "error" in outcome:
            raise outcome["error"]
    finally:
        for p in procs:
            p.join(join_s if "result" in outcome else 0.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    failed = [(rank, p.exitcode) for rank, p in enumerate(procs, start=1) if p.exitcode != 0]
    if failed:
        raise RuntimeError("profile " + ", ".join(f"rank {r} exited with code {c}" for r, c in failed))
    return outcome["result"]


def profile(model_dir: str, tp: int, ep: bool, all_reduce: str, batches: list[int], device: str,
            dist_timeout: int = 600) -> dict:
    """The budget of one decode layer on rank 0 at each batch size: {"all_reduce": what ran, "read_bandwidth",
    "budgets": {B: rows}}."""
    config = engine_config(model_dir, tp, ep, all_reduce, batches, device, dist_timeout)
    return run_ranks(rank_budgets, tp, config, model_dir, batches)
