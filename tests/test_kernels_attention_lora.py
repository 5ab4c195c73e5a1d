"""Paged attention (decode split-K, varlen prefill) and dense multi-LoRA kernels vs fp32 torch refs.

CPU: tiny fp32 shapes under the Triton interpreter. GPU (@gpu): bf16 at Qwen3-30B-A3B shapes,
and decode attention + dense LoRA captured in one CUDA graph, replayed with new metadata.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

from moeserve.kernels.lora_dense import (  # noqa: E402
    RANK_BLOCK, _dense_lora, dense_lora, dense_lora_expand, dense_lora_ref, dense_lora_shrink, group_rows)
from moeserve.layers.linear import dense_lora_torch  # noqa: E402
from moeserve.kernels.paged_attention import (  # noqa: E402
    LONG_PREFILL_TILE,
    SHORT_PREFILL_MAX_QUERY,
    SHORT_PREFILL_TILE,
    PrefillTile,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_tile,
)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_cache(lengths, block_size, n_kv, head_dim, dtype, device, gen, spare_blocks=3):
    """A KV cache holding `lengths` tokens per sequence in shuffled physical blocks.

    Block 0 (the dummy) and every slot past a sequence's length hold NaN, so any read the
    kernels should not make poisons the result. Returns k, v, block_tables [S, max_blocks].
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in lengths]
    max_blocks = max(blocks_per_seq + [1]) + 1  # one unused column, as in a padded table
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, n_kv, head_dim)
    k = torch.randn(shape, generator=gen, device=device).to(dtype)
    v = torch.randn(shape, generator=gen, device=device).to(dtype)
    k[0] = float("nan")
    v[0] = float("nan")
    physical = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32, device=device)
    used = 0
    for s, (n, nb) in enumerate(zip(lengths, blocks_per_seq)):
        ids = physical[used : used + nb]
        used += nb
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32, device=device)
        if nb and n % block_size:
            k[ids[-1], n % block_size :] = float("nan")
            v[ids[-1], n % block_size :] = float("nan")
    return k, v, tables


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


# ------------------------------------------------------------------ CPU (interpreter), fp32


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_ref(block_size, num_splits):
    gen = torch.Generator().manual_seed(block_size * 10 + num_splits)
    n_heads, n_kv, head_dim = 6, 2, 16  # GQA group of 3 (not a power of two)
    lengths = [5, 19, 0, 33, 16]  # odd, several blocks, padded row, exact block multiple
    k, v, tables = make_cache(lengths, block_size, n_kv, head_dim, torch.float32, "cpu", gen)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    # q as the engine has it: a strided view into the fused qkv output
    qkv = torch.randn(len(lengths), (n_heads + 2 * n_kv) * head_dim, generator=gen)
    q = qkv[:, : n_heads * head_dim].view(len(lengths), n_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.full((len(lengths), n_heads, head_dim), 7.0)

    got = paged_decode_attention(q, k, v, tables, ctx, scale, num_splits=num_splits, out=out)
    want = paged_decode_attention_ref(q, k, v, tables, ctx, scale)

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # padded row


def test_decode_default_splits_and_dtype():
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 1]
    k, v, tables = make_cache(lengths, 8, 1, 16, torch.float16, "cpu", gen)
    q = torch.randn(2, 4, 16, generator=gen).half()  # MQA: 4 heads on one kv head
    ctx = torch.tensor(lengths, dtype=torch.int32)
    got = paged_decode_attention(q, k, v, tables, ctx, 0.3)
    assert got.dtype == torch.float16
    want = paged_decode_attention_ref(q, k, v, tables, ctx, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("split_causal", [False, True])  # steps before a tile's first query without the mask
def test_prefill_matches_ref(block_size, split_causal):
    gen = torch.Generator().manual_seed(block_size)
    n_heads, n_kv, head_dim = 6, 2, 16
    q_lens = [5, 1, 7, 37]
    seq_lens = [5, 9, 20, 37]  # fresh prompts (one of three KV steps); one new token after 8 cached; a chunk after 13
    k, v, tables = make_cache(seq_lens, block_size, n_kv, head_dim, torch.float32, "cpu", gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32)

    got = paged_prefill_attention(q, k, v, tables, qsl, sl, 0.25, max(q_lens),
                                  tile=PrefillTile(split_causal=split_causal))
    want = paged_prefill_attention_ref(q, k, v, tables, qsl, sl, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_chunk_equals_tail_of_full_prefill_and_decode():
    """A later chunk, and the last token as decode, see exactly what a full prefill sees."""
    gen = torch.Generator().manual_seed(3)
    n = 21
    k, v, tables = make_cache([n], 8, 2, 16, torch.float32, "cpu", gen)
    q = torch.randn(n, 4, 16, generator=gen)
    sl = torch.tensor([n], dtype=torch.int32)
    full = paged_prefill_attention(q, k, v, tables, torch.tensor([0, n], dtype=torch.int32), sl, 0.25, n)
    chunk = paged_prefill_attention(q[13:], k, v, tables, torch.tensor([0, n - 13], dtype=torch.int32), sl, 0.25, n - 13)
    dec = paged_decode_attention(q[-1:], k, v, tables, sl, 0.25, num_splits=2)
    torch.testing.assert_close(chunk, full[13:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec, full[-1:], rtol=1e-5, atol=1e-5)


def test_prefill_ref_matches_sdpa():
    """The reference itself against torch SDPA on a contiguous copy of the sequence's KV."""
    gen = torch.Generator().manual_seed(4)
    seq_len, q_len, n_heads, n_kv, d = 13, 6, 4, 2, 8
    k, v, tables = make_cache([seq_len], 4, n_kv, d, torch.float32, "cpu", gen)
    q = torch.randn(q_len, n_heads, d, generator=gen)
    want = paged_prefill_attention_ref(q, k, v, tables, torch.tensor([0, q_len]), torch.tensor([seq_len]), 0.5)
    kc = torch.cat([k[b] for b in tables[0, :4].tolist()])[:seq_len]  # [seq_len, n_kv, d]
    vc = torch.cat([v[b] for b in tables[0, :4].tolist()])[:seq_len]
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kc.repeat_interleave(2, 1).transpose(0, 1), vc.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask, scale=0.5).transpose(0, 1)
    torch.testing.assert_close(want, sdpa, rtol=1e-5, atol=1e-5)


def make_lora_pool(num_slots, slice_sizes, max_rank, in_features, ranks, dtype, device, gen, poison=True):
    """Slot pool with zeros past each slot's rank; NaN past the rank block the kernels may read."""
    a = torch.randn(num_slots, len(slice_sizes), max_rank, in_features, generator=gen, device=device) * 0.1
    b = torch.randn(num_slots, sum(slice_sizes), max_rank, generator=gen, device=device) * 0.1
    for s, r in enumerate(ranks):
        a[s, :, r:] = 0
        b[s, :, r:] = 0
        if poison:
            read = math.ceil(r / RANK_BLOCK) * RANK_BLOCK
            a[s, :, read:] = float("nan")
            b[s, :, read:] = float("nan")
    return a.to(dtype), b.to(dtype), torch.tensor(ranks, dtype=torch.int32, device=device)


def int_bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("slice_sizes", [(20,), (24, 8, 8)])
@pytest.mark.parametrize("k_splits", [1, 2])
@pytest.mark.parametrize("max_rank", [32, 24])  # a pool rank off the 16-column rank steps: those masks stay
@pytest.mark.parametrize("block_t", [8, 16])  # blocks of a slot's rows: several per slot, or one with padding
def test_dense_lora_matches_ref(slice_sizes, k_splits, max_rank, block_t):
    """k_splits: partial sums over `in` that expand adds up; block_t: rows of one slot per program."""
    gen = torch.Generator().manual_seed(len(slice_sizes) * 10 + k_splits)
    T, in_features = 21, 48  # two token tiles
    ranks = [8, 0, max_rank, 4]  # slot 1 is inactive (rank 0)
    a, b, slot_ranks = make_lora_pool(4, slice_sizes, max_rank, in_features, ranks, torch.float32, "cpu", gen)
    x = torch.randn(T, in_features, generator=gen)
    slots = torch.randint(0, 4, (T,), generator=gen, dtype=torch.int32)
    slots[[2, 7, 18]] = -1
    slots[[5, 11]] = 1
    # out is a strided view into a wider buffer; -0.0 in rows that must stay bitwise untouched
    big = torch.randn(T, sum(slice_sizes) + 5, generator=gen)
    big[[2, 5, 7], 3] = -0.0
    big_before = big.clone()
    out = big[:, 2 : 2 + sum(slice_sizes)]
    want = out.clone()
    dense_lora_ref(x, a, b, slots, slot_ranks, slice_sizes, want)

    _dense_lora(x, a, b, slots, slot_ranks, slice_sizes, out, k_splits=k_splits, block_t=block_t)

    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    untouched = (slots < 0) | (slots == 1)
    assert torch.equal(int_bits(big[untouched]), int_bits(big_before[untouched]))
    assert torch.equal(int_bits(big[:, :2]), int_bits(big_before[:, :2]))
    assert torch.equal(int_bits(big[:, -3:]), int_bits(big_before[:, -3:]))
    assert not torch.equal(big[~untouched], big_before[~untouched])


def test_dense_lora_uniform_slot_and_single_token():
    gen = torch.Generator().manual_seed(7)
    sizes = (16, 16)  # gate/up-like
    a, b, ranks = make_lora_pool(3, sizes, 16, 32, [16, 16, 8], torch.float32, "cpu", gen)
    for T, slot in [(19, 2), (1, 0)]:
        x = torch.randn(T, 32, generator=gen)
        slots = torch.full((T,), slot, dtype=torch.int32)
        out = torch.randn(T, 32, generator=gen)
        want = out.clone()
        dense_lora_ref(x, a, b, slots, ranks, sizes, want)
        dense_lora(x, a, b, slots, ranks, sizes, out)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


MIXED_RANKS = [8, 16, 64, 0, 16]  # rank-64 pool; slot 3 loaded but rank 0


@pytest.mark.parametrize("T", [1, 7, 33])
def test_dense_lora_mixed_ranks(T):
    """A fused q|k|v of unequal slices, adapters of ranks 8, 16 and 64 in one batch,
    against dense_lora_ref and the layer's torch path; rows with slot -1 or a rank-0 slot stay bitwise."""
    gen = torch.Generator().manual_seed(100 + T)
    sizes, in_features = (48, 16, 16), 40  # `in` not a multiple of the k tile
    a, b, slot_ranks = make_lora_pool(len(MIXED_RANKS), sizes, 64, in_features, MIXED_RANKS, torch.float32,
                                      "cpu", gen)
    x = torch.randn(T, in_features, generator=gen)
    slots = torch.tensor([(2, -1, 0, 3, 1, 4)[t % 6] for t in range(T)], dtype=torch.int32)
    out = torch.randn(T, sum(sizes), generator=gen)
    out[:, 5] = -0.0  # a sign bit an add of zero would flip
    before = out.clone()
    want = out.clone()
    dense_lora_ref(x, a, b, slots, slot_ranks, sizes, want)
    # the layer's torch path reads every rank column: give it the pool without the NaN poison
    want_torch = out.clone()
    dense_lora_torch(x, a.nan_to_num(0.0), b.nan_to_num(0.0), slots, slot_ranks, sizes, want_torch)

    apart = out.clone()
    dense_lora(x, a, b, slots, slot_ranks, sizes, out)

    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want_torch, rtol=1e-5, atol=1e-5)
    untouched = (slots < 0) | (slot_ranks[slots.clamp_min(0).long()] == 0)
    assert torch.equal(int_bits(out[untouched]), int_bits(before[untouched]))
    assert (out[~untouched] != before[~untouched]).any(dim=1).all()  # every adapter row moved
    # the shrink and the expand launched apart on one grouping (a projection whose shrink runs beside its GEMM)
    groups = group_rows(slots, len(MIXED_RANKS))
    dense_lora_expand(dense_lora_shrink(x, a, slots, slot_ranks, groups), b, slot_ranks, groups, sizes, apart)
    assert torch.equal(int_bits(apart), int_bits(out))


@pytest.mark.parametrize("flag, fp8, beside", [(None, True, True), (None, False, False), (True, False, True),
                                                (True, True, True), (False, True, False), (False, False, False)])
def test_which_projections_shrink_beside_their_gemm(flag, fp8, beside):
    """--lora-side-stream unset: the shrink runs beside the FP8 GEMM only (measured to pay there, not beside bf16
    cuBLAS at large batches); set: beside every GEMM; --no-lora-side-stream: never."""
    from moeserve.exec_options import PLAIN_WEIGHTS, ExecOptions, WeightFormat
    from moeserve.layers.linear import LoRALinear

    weights = WeightFormat(method="fp8") if fp8 else PLAIN_WEIGHTS
    module = LoRALinear(256, (128,), False, ExecOptions(linear_backend="triton", lora_side_stream=flag),
                        weights=weights)
    assert module.shrink_beside is beside


def test_dense_lora_refuses_rows_grouped_for_another_batch():
    """A grouping is one forward's: a projection handed another batch's (another row count) must not read it."""
    gen = torch.Generator().manual_seed(9)
    a, b, ranks = make_lora_pool(2, (16,), 16, 32, [16, 8], torch.float32, "cpu", gen)
    slots = torch.tensor([0, 1, -1, 0, 1, 0], dtype=torch.int32)
    x, out = torch.randn(6, 32, generator=gen), torch.zeros(6, 16)
    with pytest.raises(ValueError, match="grouped for 5 tokens, x has 6"):
        dense_lora(x, a, b, slots, ranks, (16,), out, groups=group_rows(slots[:5], 2))
    want = out.clone()
    dense_lora_ref(x, a, b, slots, ranks, (16,), want)
    dense_lora(x, a, b, slots, ranks, (16,), out, groups=group_rows(slots, 2))  # its own: the same as made inside
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_dense_lora_ref_matches_dense_math():
    """The reference against the per-token dense formula with full-size A/B (zeros past rank)."""
    gen = torch.Generator().manual_seed(8)
    sizes = (6, 4)
    a, b, ranks = make_lora_pool(2, sizes, 5, 7, [3, 5], torch.float32, "cpu", gen, poison=False)
    x = torch.randn(4, 7, generator=gen)
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    out = torch.zeros(4, 10)
    dense_lora_ref(x, a, b, slots, ranks, sizes, out)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(out[t], torch.zeros(10))
            continue
        delta_q = b[s, :6] @ (a[s, 0] @ x[t])
        delta_k = b[s, 6:] @ (a[s, 1] @ x[t])
        torch.testing.assert_close(out[t], torch.cat([delta_q, delta_k]))


# ------------------------------------------------------------------ GPU, bf16, Qwen3-30B-A3B shapes

QWEN3 = dict(n_heads=32, n_kv=4, head_dim=128, hidden=2048)


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_gpu_decode_qwen3_bf16(batch):
    gen = torch.Generator(device="cuda").manual_seed(batch)
    lengths = torch.randint(512, 2049, (batch,), generator=gen, device="cuda").tolist()
    if batch > 1:
        lengths[batch // 2] = 0  # padded row
    k, v, tables = make_cache(lengths, 16, QWEN3["n_kv"], QWEN3["head_dim"], torch.bfloat16, "cuda", gen)
    q = torch.randn(batch, QWEN3["n_heads"], QWEN3["head_dim"], generator=gen, device="cuda").bfloat16()
    ctx = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = QWEN3["head_dim"] ** -0.5
    want = paged_decode_attention_ref(q, k, v, tables, ctx, scale)
    for splits in (None, 1, 5):
        got = paged_decode_attention(q, k, v, tables, ctx, scale, num_splits=splits)
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2, splits
        if batch > 1:
            assert torch.equal(got[batch // 2], torch.zeros_like(got[0]))


@gpu
@needs_cuda
@pytest.mark.parametrize("tile", [PrefillTile(), PrefillTile(split_causal=True), PrefillTile(64, 128, 4, 3, True),
                                  SHORT_PREFILL_TILE, LONG_PREFILL_TILE],
                         ids=["default", "split_causal", "m64_n128_split", "short", "long"])
def test_gpu_prefill_qwen3_bf16(tile):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_lens = [512, 1, 300, 77]
    seq_lens = [512, 1024, 2048, 77]
    k, v, tables = make_cache(seq_lens, 16, QWEN3["n_kv"], QWEN3["head_dim"], torch.bfloat16, "cuda", gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), QWEN3["n_heads"], QWEN3["head_dim"], generator=gen, device="cuda").bfloat16()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = QWEN3["head_dim"] ** -0.5
    got = paged_prefill_attention(q, k, v, tables, qsl, sl, scale, max(q_lens), tile=tile)
    want = paged_prefill_attention_ref(q, k, v, tables, qsl, sl, scale)
    assert rel_err(got, want) < 1e-2
    if tile.block_n == PrefillTile().block_n:  # the same KV steps, so the same online-softmax order: the same bits
        assert torch.equal(got, paged_prefill_attention(q, k, v, tables, qsl, sl, scale, max(q_lens),
                                                        tile=PrefillTile()))


@gpu
@needs_cuda
@pytest.mark.parametrize("q_len", [1, SHORT_PREFILL_MAX_QUERY, SHORT_PREFILL_MAX_QUERY + 1, 2048])
def test_gpu_prefill_launch_by_query_length(q_len):
    """The engine's call (no tile) runs prefill_tile's launch for its longest query, and matches the reference."""
    gen = torch.Generator(device="cuda").manual_seed(q_len)
    q_lens, seq_lens = [q_len, 1], [q_len + 100, 40]
    k, v, tables = make_cache(seq_lens, 16, QWEN3["n_kv"], QWEN3["head_dim"], torch.bfloat16, "cuda", gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), QWEN3["n_heads"], QWEN3["head_dim"], generator=gen, device="cuda").bfloat16()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = QWEN3["head_dim"] ** -0.5
    got = paged_prefill_attention(q, k, v, tables, qsl, sl, scale, q_len)
    want_tile = SHORT_PREFILL_TILE if q_len <= SHORT_PREFILL_MAX_QUERY else LONG_PREFILL_TILE
    assert prefill_tile(q_len) == want_tile
    assert torch.equal(got, paged_prefill_attention(q, k, v, tables, qsl, sl, scale, q_len, tile=want_tile))
    assert rel_err(got, paged_prefill_attention_ref(q, k, v, tables, qsl, sl, scale)) < 1e-2


QKV_SIZES = (4096, 512, 512)


DENSE_SHAPES = {"qkv": (QKV_SIZES, QWEN3["hidden"]), "o": ((QWEN3["hidden"],), QWEN3["n_heads"] * QWEN3["head_dim"])}


@gpu
@needs_cuda
@pytest.mark.parametrize("proj", ["qkv", "o"])
@pytest.mark.parametrize("T", [1, 8, 64, 256, 2048])
def test_gpu_dense_lora_qwen3_bf16(T, proj):
    """bf16 at Qwen3-30B-A3B shapes, ranks 8..64 mixed in a rank-64 pool, default and other row blocks."""
    gen = torch.Generator(device="cuda").manual_seed(T)
    sizes, in_features = DENSE_SHAPES[proj]
    ranks = [16, 8, 0, 64, 16, 16, 32, 16]  # rank 16 typical; pool max rank 64
    a, b, slot_ranks = make_lora_pool(8, sizes, 64, in_features, ranks, torch.bfloat16, "cuda", gen)
    x = torch.randn(T, in_features, generator=gen, device="cuda").bfloat16()
    slots = torch.randint(-1, 8, (T,), generator=gen, device="cuda", dtype=torch.int32)
    want = torch.zeros(T, sum(sizes), dtype=torch.float32, device="cuda")
    dense_lora_ref(x, a, b, slots, slot_ranks, sizes, want)
    active = (slots >= 0) & (slot_ranks[slots.clamp_min(0).long()] > 0)
    variants = {"default": lambda *args: dense_lora(*args)}
    for block_t in (16, 64):
        variants[f"block_t{block_t}"] = lambda *args, block_t=block_t: _dense_lora(*args, block_t=block_t)
    for name, fn in variants.items():
        out = torch.zeros(T, sum(sizes), dtype=torch.bfloat16, device="cuda")
        fn(x, a, b, slots, slot_ranks, sizes, out)
        if active.any():
            assert rel_err(out, want) < 1e-2, name
        assert torch.equal(out[~active], torch.zeros_like(out[~active])), name


@gpu
@needs_cuda
def test_gpu_cuda_graph_decode_attention_and_lora():
    """Capture once, replay with new context lengths, block tables, queries and adapter slots."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, block_size, max_blocks = 48, 16, 128
    n_heads, n_kv, d, hidden = QWEN3["n_heads"], QWEN3["n_kv"], QWEN3["head_dim"], QWEN3["hidden"]
    num_blocks = 1 + batch * max_blocks
    k = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, device=dev).bfloat16()
    v = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, device=dev).bfloat16()
    ranks = [16, 8, 0, 64]
    a, b, slot_ranks = make_lora_pool(4, QKV_SIZES, 64, hidden, ranks, torch.bfloat16, dev, gen)
    scale = d**-0.5

    # static buffers, as a graph runner holds them
    q = torch.zeros(batch, n_heads, d, dtype=torch.bfloat16, device=dev)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev)
    ctx = torch.zeros(batch, dtype=torch.int32, device=dev)
    x = torch.zeros(batch, hidden, dtype=torch.bfloat16, device=dev)
    slots = torch.full((batch,), -1, dtype=torch.int32, device=dev)
    attn_out = torch.empty(batch, n_heads, d, dtype=torch.bfloat16, device=dev)
    lora_out = torch.empty(batch, sum(QKV_SIZES), dtype=torch.bfloat16, device=dev)

    def step():
        paged_decode_attention(q, k, v, tables, ctx, scale, out=attn_out)
        lora_out.zero_()
        dense_lora(x, a, b, slots, slot_ranks, QKV_SIZES, lora_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial in range(3):
        lengths = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen, device=dev)
        lengths[trial::7] = 0  # padded rows move around
        if trial == 2:
            lengths[0] = max_blocks * block_size
        ctx.copy_(lengths.int())
        tables.copy_((torch.randperm(num_blocks - 1, generator=gen, device=dev)[: batch * max_blocks] + 1)
                     .view(batch, max_blocks).int())
        q.copy_(torch.randn(q.shape, generator=gen, device=dev))
        x.copy_(torch.randn(x.shape, generator=gen, device=dev))
        slots.copy_(torch.randint(-1, 4, (batch,), generator=gen, device=dev).int())
        graph.replay()
        torch.cuda.synchronize()

        want_attn = paged_decode_attention_ref(q, k, v, tables, ctx, scale)
        want_lora = torch.zeros(batch, sum(QKV_SIZES), device=dev)
        dense_lora_ref(x, a, b, slots, slot_ranks, QKV_SIZES, want_lora)
        assert rel_err(attn_out, want_attn) < 1e-2, trial
        assert torch.equal(attn_out[ctx == 0], torch.zeros_like(attn_out[ctx == 0]))
        assert rel_err(lora_out, want_lora) < 1e-2, trial
