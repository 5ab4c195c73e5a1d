"""Test helpers: logits of every prompt position through an engine's own batch code and forward; random prompts;
a transformers model's greedy continuation."""
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


def prompt_ids(n: int, seed: int) -> list[int]:
    """n random token ids in [3, 512), reproducible by seed."""
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def transformers_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation of a transformers causal LM (no EOS stop), the new tokens only."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
