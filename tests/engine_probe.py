"""Test helper: logits of every prompt position through an engine's own batch code and forward."""
import torch

from moeserve.worker.sequence import ScheduledBatch
from moeserve.worker.sequence import Sequence
from moeserve.sampling_params import SamplingParams


def prompt_logits(engine, ids: list[int], lora: str | None = None) -> torch.Tensor:
    seq = Sequence("probe", ids, SamplingParams(max_tokens=1), lora)
    if lora is not None:
        assert engine.lora_manager.acquire(seq)
    assert engine.allocator.grow(seq.block_table, len(ids))
    try:
        batch = engine.runner.prepare(ScheduledBatch([seq], [len(ids)], is_decode=False))
        with torch.inference_mode():
            return engine.runner.model.compute_logits(engine.runner.model(batch))
    finally:
        engine.allocator.release(seq.block_table)
        if engine.lora_manager is not None:
            engine.lora_manager.release(seq)
