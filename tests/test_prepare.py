"""ModelRunner.prepare: a decode batch takes a fast path (one row per sequence, no inner loops, block tables
through one numpy mask); it must give exactly the tensors the general (prefill) path gives for the same rows, and
both must match the rows written out by hand."""
from __future__ import annotations

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.lora.slot_pool import LoRASlotPool
from moeserve.model_spec import ModelSpec
from moeserve.models import loader
from moeserve.sampling_params import SamplingParams
from moeserve.worker.model_runner import ModelRunner, block_table_array
from moeserve.worker.sequence import PENDING, ScheduledBatch, Sequence

SPEC = ModelSpec(family="qwen3_moe", vocab_size=96, hidden_size=32, num_layers=1, sparse_layers=(True,),
                 num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=16,
                 intermediate_size=32, norm_topk_prob=True, max_position_embeddings=256)
BS = 4


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(model="random", device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                       block_size=BS, moe_backend="torch", attention_backend="torch",
                       linear_backend="torch").resolve()
    model = loader.random_model(SPEC, cfg.exec_options())
    r = ModelRunner(cfg, SPEC, None, model=model)
    r.lora_pool = LoRASlotPool(SPEC, model, 3, 4, {"q_proj"}, r.device, r.dtype)
    return r


def seq(name, prompt, outputs, pending_row, table, slot):
    s = Sequence(name, prompt, SamplingParams(temperature=0.0))
    s.output_token_ids = list(outputs)
    if pending_row is not None:
        s.output_token_ids.append(PENDING)
        s.num_pending, s.pending_row = 1, pending_row
    s.num_computed_tokens = s.num_tokens - 1
    s.block_table = list(table)
    s.lora_slot = slot
    return s


def mixed_batch() -> list[Sequence]:
    return [
        seq("pending-adapter", [3, 4, 5, 6, 7], [8], 2, [9, 4], 1),  # position 6, block 4 offset 2
        seq("plain-no-adapter", [10, 11, 12], [13, 14, 15], None, [5, 7], -1),  # position 5: last output 15
        seq("pending-long", list(range(20, 29)), [1, 2], 0, [11, 12, 13, 2], 2),  # position 11: block 13, off 3
        seq("prompt-last", [30, 31, 32, 33], [], None, [6], 1),  # position 3: last prompt token (33)
    ]


def test_block_table_array_pads_each_row_with_block_zero():
    got = block_table_array([[9, 4], [5], [11, 12, 13, 2], []])
    assert got.dtype.name == "int32"
    assert got.tolist() == [[9, 4, 0, 0], [5, 0, 0, 0], [11, 12, 13, 2], [0, 0, 0, 0]]


@pytest.mark.parametrize("on_host", [True, False])
@torch.inference_mode()
def test_decode_fast_path_gives_the_general_paths_tensors(runner, on_host):
    seqs = mixed_batch()
    fast = runner.prepare(ScheduledBatch(seqs, [1] * 4, is_decode=True), on_host=on_host)
    general = runner.prepare(ScheduledBatch(seqs, [1] * 4, is_decode=False), on_host=on_host)
    # by hand: PENDING inputs as -(row + 1); slot = block * BS + offset; tables padded to the longest with 0
    expected = {
        "input_ids": ([-3, 15, -1, 33], torch.int64),
        "positions": ([6, 5, 11, 3], torch.int64),
        "slot_mapping": ([4 * BS + 2, 7 * BS + 1, 13 * BS + 3, 6 * BS + 3], torch.int64),
        "block_tables": ([[9, 4, 0, 0], [5, 7, 0, 0], [11, 12, 13, 2], [6, 0, 0, 0]], torch.int32),
        "context_lens": ([7, 6, 12, 4], torch.int32),
        "token_slots": ([1, -1, 2, 1], torch.int32),
    }
    for batch in (fast, general):
        got = {"input_ids": batch.input_ids, "positions": batch.positions,
               "slot_mapping": batch.attn.slot_mapping, "block_tables": batch.attn.block_tables,
               "context_lens": batch.attn.context_lens, "token_slots": batch.lora.token_slots}
        for name, (values, dtype) in expected.items():
            assert got[name].dtype == dtype, name
            assert got[name].tolist() == values, name
        assert batch.lora.active_slots == (1, 2)
        assert batch.attn.seq_lens_host == [7, 6, 12, 4]
        assert batch.attn.query_start_loc_host == [0, 1, 2, 3, 4]
        assert batch.attn.max_query_len == 1
    assert fast.attn.is_decode and fast.attn.query_start_loc is None
    assert general.attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@torch.inference_mode()
def test_decode_batch_without_adapters_has_no_lora_batch(runner):
    seqs = [s for s in mixed_batch() if s.lora_slot < 0]
    assert runner.prepare(ScheduledBatch(seqs, [1], is_decode=True)).lora is None


@torch.inference_mode()
def test_prefill_rows_span_blocks_and_sequences(runner):
    a = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams())
    a.block_table, a.num_computed_tokens, a.lora_slot = [7, 3], 1, 2  # positions 1..5 cross into block 3
    b = Sequence("b", [9, 8, 7], SamplingParams())
    b.block_table, b.lora_slot = [5], -1
    batch = runner.prepare(ScheduledBatch([a, b], [5, 3], is_decode=False))
    assert batch.input_ids.tolist() == [2, 3, 4, 5, 6, 9, 8, 7]
    assert batch.positions.tolist() == [1, 2, 3, 4, 5, 0, 1, 2]
    assert batch.attn.slot_mapping.tolist() == [29, 30, 31, 12, 13, 20, 21, 22]
    assert batch.attn.block_tables.tolist() == [[7, 3], [5, 0]]
    assert batch.attn.context_lens.tolist() == [6, 3]
    assert batch.attn.query_start_loc.tolist() == [0, 5, 8]
    assert batch.lora.token_slots.tolist() == [2] * 5 + [-1] * 3
