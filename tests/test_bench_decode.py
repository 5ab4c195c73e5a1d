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


def test_fp8_kv_cache_is_filled_in_fp8_and_its_floor_counts_one_byte_per_element():
    """`bench decode --kv-cache-dtype fp8`: the prompt context drawn N(0, 1) and stored e4m3 (no fp8 normal_ exists),
    the step decodes on it, and the roofline floor counts the KV cache at one byte per element."""
    from moeserve.bench.decode import floor_bytes

    bench = DecodeBench(SPEC, max_bs=2, steps=2, device="cpu", dtype=torch.float32, backend="torch",
                        kv_cache_dtype="fp8")
    k_cache, v_cache = bench.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    values = k_cache.float()
    assert values.isfinite().all() and 0.8 < values.std().item() < 1.2
    seqs = bench.sequences(2, [-1, -1])
    bench.run_steps(seqs, sync_steps=True)
    assert all(len(s.output_token_ids) == 2 + WARMUP_STEPS for s in seqs)
    B, ctx = 256, 512
    kv_bytes = SPEC.num_layers * B * ctx * 2 * SPEC.kv_size * 2  # bf16
    assert floor_bytes(SPEC, B, ctx, []) - floor_bytes(SPEC, B, ctx, [], kv_fp8=True) == kv_bytes / 2


def test_prefill_profile_files_each_lora_kernel_under_its_region():
    """The prefill budget's LoRA regions follow the kernels' names: a rename must not move them to "other"."""
    from moeserve.bench.prefill import region_of
    from moeserve.kernels import lora_dense, moe_lora

    assert {region_of(k.__name__) for k in (lora_dense._dense_lora_shrink_kernel,
                                            lora_dense._dense_lora_expand_kernel)} == {"dense LoRA"}
    assert region_of(moe_lora._lora_block_shrink_kernel.__name__) == "expert LoRA"


def test_held_bytes_counts_each_storage_once_at_its_own_width():
    """The weights line of `bench decode`: parameters and buffers by their storages' bytes (an fp8 weight one byte
    an element, its fp32 scales four), a tied weight and a view of a buffer counted once."""
    from moeserve.bench.decode import held_bytes

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 8, dtype=torch.bfloat16)
    model.head = torch.nn.Linear(8, 10, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("w_fp8", torch.zeros(16, 32, dtype=torch.float8_e4m3fn))
    model.register_buffer("scale", torch.ones(1, 1))
    model.register_buffer("rows", model.w_fp8[:4])  # a view: no storage of its own
    assert held_bytes(model) == 10 * 8 * 2 + 16 * 32 + 4
