"""`bench decode` times the engine's pipelined step (launch step n+1, then read step n, PENDING input tokens
resolved on the device, the engine core's own bookkeeping); `--sync-steps` the synchronous one. Both must
decode the same greedy tokens: the synchronous loop picks and appends each step's tokens itself, so it is the
reference for the pipelined loop's launch / mark_launched / collect / fill_pending."""
from __future__ import annotations

import pytest
import torch

from moeserve.bench.decode import PROMPT, WARMUP_STEPS, DecodeBench
from moeserve.model_spec import ModelSpec
from moeserve.worker.graph_runner import LORA, NOLORA, EagerGraph
from moeserve.worker.sequence import PENDING

SPEC = ModelSpec(family="qwen3_moe", vocab_size=96, hidden_size=64, num_layers=2, sparse_layers=(True, True),
                 num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=48,
                 intermediate_size=80, norm_topk_prob=True, max_position_embeddings=1024, qk_norm="head")
STEPS = 5


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("slots", [[-1, -1, -1], [0, -1, 2]], ids=["base", "mixed"])
def test_pipelined_steps_decode_the_synchronous_steps_tokens(graphed, slots):
    bench = DecodeBench(SPEC, max_bs=4, steps=STEPS, device="cpu", dtype=torch.float32, backend="torch",
                        graph_factory=EagerGraph)
    lora = any(s >= 0 for s in slots)
    if lora:
        bench.attach_lora_pool()
    bench.runner.graph_runner = bench.graphs([2, 4], [LORA, NOLORA] if lora else [NOLORA]) if graphed else None
    sync = bench.sequences(3, slots)
    bench.run_steps(sync, sync_steps=True)
    piped = bench.sequences(3, slots)
    bench.run_steps(piped)
    if graphed:  # the 3 rows ran padded to the 4-row graph
        assert sum(bench.runner.graph_runner.replays.values()) == 2 * (STEPS + WARMUP_STEPS)
    for ref, seq in zip(sync, piped):
        assert len(ref.output_token_ids) == STEPS + WARMUP_STEPS
        assert seq.output_token_ids == ref.output_token_ids, seq.request_id
        assert seq.num_pending == 0 and PENDING not in seq.output_token_ids
        assert seq.num_computed_tokens == ref.num_computed_tokens == PROMPT - 1 + STEPS + WARMUP_STEPS
    # later steps read earlier steps' tokens: a pipelined input left unresolved would not decode these
    assert len({t for s in sync for t in s.output_token_ids}) > 1
