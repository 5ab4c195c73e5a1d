"""What every tensor-parallel rank runs per step, rank 0 (worker/parallel_runner.py) and the others
(worker/tp_worker.py) alike: the batch as it travels in a StepPlan (worker/tp_messages.py), the forward itself, and
the symmetric all-reduce buffer every rank asks for."""
from __future__ import annotations

import gc
from dataclasses import fields, replace

import numpy as np
import torch

from moeserve.config import EngineConfig
from moeserve.distributed.parallel_state import SYMM_MEM_MAX_BYTES
from moeserve.layers.batch import AttentionMetadata, ForwardBatch, LoRABatch
from moeserve.model_spec import ModelSpec
from moeserve.worker.graph_runner import GraphKey
from moeserve.worker.model_runner import ModelRunner
from moeserve.worker.sequence import resolve_pending


def symm_mem_buffer(config: EngineConfig, spec: ModelSpec) -> tuple[int, torch.dtype] | None:
    """The symmetric all-reduce buffer every rank asks for, (elements, dtype), or None under
    --disable-custom-all-reduce. It holds the largest forward's activations (a prefill chunk or a decode
    batch, [rows, hidden]) up to SYMM_MEM_MAX_BYTES; larger ones go through NCCL. Computed from the config
    alone, so every rank asks for the same."""
    if config.disable_custom_all_reduce or config.tensor_parallel_size < 2:
        return None
    dtype = config.torch_dtype
    row_bytes = spec.hidden_size * dtype.itemsize
    rows = min(max(config.max_num_batched_tokens, config.max_num_seqs), max(1, SYMM_MEM_MAX_BYTES // row_bytes))
    return rows * spec.hidden_size, dtype


def batch_to_wire(b: ForwardBatch) -> dict:
    """A host ForwardBatch as picklable numpy arrays and plain values, field by field (a field added to the
    batch travels without changes here). LoRA slot ranks stay behind: each rank has its own buffer."""
    def wire(obj):
        return {f.name: (v.numpy() if isinstance(v, torch.Tensor) else v) for f in fields(obj)
                if f.name not in ("attn", "lora", "slot_ranks") for v in [getattr(obj, f.name)]}

    return {"batch": wire(b), "attn": wire(b.attn), "lora": None if b.lora is None else wire(b.lora)}


def batch_from_wire(w: dict, slot_ranks: torch.Tensor | None) -> ForwardBatch:
    """The host ForwardBatch again (tensors on the CPU), with this rank's LoRA slot ranks."""
    def unwire(d):
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in d.items()}

    lora = None if w["lora"] is None else LoRABatch(slot_ranks=slot_ranks, **unwire(w["lora"]))
    return ForwardBatch(attn=AttentionMetadata(**unwire(w["attn"])), lora=lora, **unwire(w["batch"]))


def _to_device(b: ForwardBatch, device: torch.device) -> ForwardBatch:
    """Every host tensor of the batch on `device` (the LoRA slot ranks are already there)."""
    def moved(obj):
        values = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name != "slot_ranks"}
        return replace(obj, **{k: v.to(device, non_blocking=True) for k, v in values.items()
                               if isinstance(v, torch.Tensor)})

    return replace(moved(b), attn=moved(b.attn), lora=None if b.lora is None else moved(b.lora))


def run_forward(runner: ModelRunner, host_batch: ForwardBatch, key: GraphKey | None,
                pending: torch.Tensor | None) -> torch.Tensor:
    """The step's forward, on any rank: replay `key`'s graph, or run eagerly."""
    if key is not None:
        return runner.graph_runner.replay(key, host_batch, pending)
    batch = _to_device(host_batch, runner.device)
    if pending is not None:
        resolve_pending(batch.input_ids, pending)
    return runner.model(batch)


def release_graphs(runner: ModelRunner) -> None:
    """Destroy the runner's CUDA graphs. Graphs that recorded NCCL collectives hold on to the communicator's
    resources until they are destroyed, and NCCL's teardown waits for them (both ranks hung in
    destroy_process_group on two H200s while the graphs were alive)."""
    runner.graph_runner = None
    gc.collect()
    device = getattr(runner, "device", None)  # unset when rank 0 failed while loading its shard
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
