"""Decode CUDA graphs keyed by (batch size, LoRA variant).

With LoRA enabled and dual capture on, every bucket gets two graphs: `lora` records the
forward with a LoRABatch (per-row slots read from a static buffer), `nolora` records the
forward with `lora=None` — the very call an engine without LoRA makes, so it holds no LoRA
work at all. The variant is picked on the host from request metadata.

Ownership (invariant 1): the static *input* buffers are shared by both variants of a size
and hold no variant-dependent content (the token-slot buffer is only read by `lora` graphs);
everything prepared for capture — the ForwardBatch views, the graph, its output — is stored
under the full GraphKey, so capturing one variant can never overwrite the other's state.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from moeserve.config import EngineConfig
from moeserve.layers.batch import AttentionMetadata, ForwardBatch, LoRABatch
from moeserve.worker.sequence import resolve_pending

logger = logging.getLogger("moeserve")

NOLORA, LORA = "nolora", "lora"


@dataclass(frozen=True, order=True)
class GraphKey:
    batch_size: int
    variant: str  # "nolora" | "lora"

    def __str__(self) -> str:
        return f"bs{self.batch_size}-{self.variant}"


def graph_batch_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """Buckets: 1, 2, 4, 8, then steps of 8 to 32, steps of 16 to 128, steps of 32 beyond; capped at max_bs."""
    if explicit:
        return sorted(set(explicit))
    sizes = [1, 2, 4, 8] + list(range(16, 33, 8)) + list(range(48, 129, 16)) + list(range(160, 4097, 32))
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


def pick_bucket(sizes: list[int], n: int) -> int | None:
    """Smallest captured batch size >= n (None: run eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def dual_capture_plan(config: EngineConfig) -> tuple[list[str], str | None]:
    """Which variants to capture, and a warning when --record-nolora-graph, set by the user (True; None is the
    default), cannot take effect."""
    if not config.enable_lora:
        return [NOLORA], None
    if config.record_nolora_graph is False:
        return [LORA], None
    warning = None
    if config.enforce_eager:
        warning = ("--record-nolora-graph has no effect: CUDA graphs are disabled "
                   f"(--enforce-eager, or device={config.device!r})")
    elif config.moe_backend != "triton":
        warning = (f"--record-nolora-graph has no effect: moe_backend={config.moe_backend!r} is not one whose "
                   "dual capture is validated (triton); capturing one LoRA graph per batch size")
    if warning is not None:
        return [LORA], (warning if config.record_nolora_graph else None)
    return [LORA, NOLORA], None


def resolve_variant(lora_slots: list[int], variants: list[str]) -> str:
    """Host-side choice: `lora` if any row has an adapter (slots hold adapters of rank > 0), else `nolora`.
    With a single captured variant that is the one to replay (no-adapter rows run with slot -1)."""
    if len(variants) == 1:
        return variants[0]
    return LORA if any(s >= 0 for s in lora_slots) else NOLORA


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraph:
    """One torch.cuda.CUDAGraph captured into the runner's shared memory pool."""

    def __init__(self, pool):
        self.pool = pool
        try:  # keep the cudaGraph_t so its kernel nodes can be counted (torch >= 2.8)
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)
            self.kept = True
        except TypeError:
            self.graph = torch.cuda.CUDAGraph()
            self.kept = False

    def capture(self, fn):
        for _ in range(2):  # warm-ups: Triton JIT, allocator, cuBLAS workspaces
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        if self.kept:
            self.graph.instantiate()
        return out

    def replay(self):
        self.graph.replay()

    def num_kernels(self) -> int | None:
        """Kernel nodes recorded in the graph (None where cuda-python is unavailable)."""
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            return None
        if not self.kept:
            return None
        handle = self.graph.raw_cuda_graph()
        err, _, n = cudart.cudaGraphGetNodes(handle, 0)
        err, nodes, n = cudart.cudaGraphGetNodes(handle, n)
        kernel = cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel
        return sum(1 for node in nodes if cudart.cudaGraphNodeGetType(node)[1] == kernel)


class EagerGraph:
    """Stand-in with the same interface for CPU: 'replay' re-runs the forward on the static buffers,
    so CI exercises bucketing, padding, static-buffer plumbing, keys and counters."""

    def __init__(self, pool=None):
        self.fn = None
        self.out = None

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


class StaticBuffers:
    """Inputs sized once for the largest bucket; every key reads a [:bs] view of these."""

    def __init__(self, max_bs: int, max_blocks: int, device):
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.token_slots = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks

    def fill(self, batch: ForwardBatch, bs: int, pending: torch.Tensor | None = None) -> None:
        """Copy a decode batch of n rows in (from pinned host tensors: one asynchronous copy each); rows
        n..bs-1 become inert padding (dummy slot, no context, no adapter). `pending`: the previous step's
        sampled tokens, which rows continuing from it read their input token from."""
        n = batch.num_tokens
        copy = dict(non_blocking=True)
        self.input_ids[:n].copy_(batch.input_ids, **copy)
        if pending is not None:
            resolve_pending(self.input_ids[:n], pending)
        self.positions[:n].copy_(batch.positions, **copy)
        self.slot_mapping[:n].copy_(batch.attn.slot_mapping, **copy)
        width = batch.attn.block_tables.shape[1]
        self.block_tables[:n, width:].zero_()
        self.block_tables[:n, :width].copy_(batch.attn.block_tables, **copy)
        self.context_lens[:n].copy_(batch.attn.context_lens, **copy)
        if batch.lora is not None:
            self.token_slots[:n].copy_(batch.lora.token_slots, **copy)
        else:
            self.token_slots[:n].fill_(-1)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()  # block 0 is the dummy block
            self.block_tables[n:bs].zero_()
            self.context_lens[n:bs].zero_()
            self.token_slots[n:bs].fill_(-1)

    def batch_for(self, key: GraphKey, slot_ranks: torch.Tensor | None) -> ForwardBatch:
        bs = key.batch_size
        attn = AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 context_lens=self.context_lens[:bs], is_decode=True, max_query_len=1)
        lora = LoRABatch(self.token_slots[:bs], slot_ranks) if key.variant == LORA else None
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], attn, lora)


class GraphRunner:
    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: list[int], variants: list[str],
                 max_blocks: int, device, slot_ranks: torch.Tensor | None, graph_factory=None, pool=None):
        self.forward = forward
        self.sizes = sorted(sizes)
        self.variants = variants
        self.slot_ranks = slot_ranks
        self.buffers = StaticBuffers(self.sizes[-1], max_blocks, device)
        self.graph_factory = graph_factory or EagerGraph
        self.pool = pool
        self.graphs: dict[GraphKey, Graph] = {}
        self.batches: dict[GraphKey, ForwardBatch] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.replays: dict[GraphKey, int] = {}
        self.capture_seconds = {v: 0.0 for v in variants}
        self.pool_bytes = {v: 0 for v in variants}

    @classmethod
    def for_engine(cls, runner, config: EngineConfig, progress: bool = False) -> "GraphRunner":
        variants, _ = dual_capture_plan(config)  # the engine logs the plan's warning once
        sizes = graph_batch_sizes(min(config.cuda_graph_max_bs, config.max_num_seqs), config.cuda_graph_bs)
        on_cuda = runner.device.type == "cuda"
        gr = cls(runner.model, sizes, variants, runner.max_blocks_per_seq, runner.device,
                 runner.lora_pool.slot_ranks if runner.lora_pool is not None else None,
                 graph_factory=CudaGraph if on_cuda else EagerGraph,
                 pool=torch.cuda.graph_pool_handle() if on_cuda else None)
        gr.capture_all(progress=progress)
        return gr

    def keys(self) -> list[GraphKey]:
        return [GraphKey(bs, v) for bs in sorted(self.sizes, reverse=True) for v in self.variants]

    def capture_all(self, progress: bool = False) -> None:
        """Largest size first (later, smaller graphs reuse the pool), both variants per size."""
        keys = self.keys()
        if progress:
            from tqdm import tqdm

            keys = tqdm(keys, desc="capturing decode graphs", unit="graph")
        for key in keys:
            self.capture(key)
        for v in self.variants:
            logger.info("captured %d %s graphs in %.1f s, pool +%.1f MiB", len(self.sizes), v,
                        self.capture_seconds[v], self.pool_bytes[v] / 2**20)

    @torch.inference_mode()
    def capture(self, key: GraphKey) -> None:
        """Capture one key; everything it prepares is stored under that key only."""
        on_cuda = self.graph_factory is CudaGraph
        if on_cuda:  # capture empties the allocator cache; do it first so the delta is the pool's growth
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        mem0 = torch.cuda.memory_reserved() if on_cuda else 0
        t0 = time.perf_counter()
        batch = self.buffers.batch_for(key, self.slot_ranks)
        graph = self.graph_factory(self.pool)
        out = graph.capture(lambda: self.forward(batch))
        if on_cuda:
            torch.cuda.synchronize()
        self.capture_seconds[key.variant] = self.capture_seconds.get(key.variant, 0.0) + time.perf_counter() - t0
        self.pool_bytes[key.variant] = self.pool_bytes.get(key.variant, 0) + (
            torch.cuda.memory_reserved() - mem0 if on_cuda else 0)
        self.graphs[key], self.batches[key], self.outputs[key] = graph, batch, out
        self.replays[key] = 0

    def can_run(self, sb) -> bool:
        return sb.is_decode and pick_bucket(self.sizes, len(sb.seqs)) is not None

    def key_for(self, batch: ForwardBatch, lora_slots: list[int]) -> GraphKey:
        return GraphKey(pick_bucket(self.sizes, batch.num_tokens), resolve_variant(lora_slots, self.variants))

    def run(self, sb, batch: ForwardBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        return self.replay(self.key_for(batch, [s.lora_slot for s in sb.seqs]), batch, pending)

    def replay(self, key: GraphKey, batch: ForwardBatch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Replay `key`'s graph on `batch` (the key decided once, on the host: under tensor parallelism by
        rank 0 for every rank)."""
        self.buffers.fill(batch, key.batch_size, pending)
        self.graphs[key].replay()
        self.replays[key] += 1
        return self.outputs[key][:batch.num_tokens]

    def replay_counts(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.replays.items())}

    def capture_report(self) -> dict:
        return {"sizes": self.sizes, "variants": self.variants, "capture_seconds": self.capture_seconds,
                "pool_bytes": self.pool_bytes}
