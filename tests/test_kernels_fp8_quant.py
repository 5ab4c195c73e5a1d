"""Block-wise FP8 quantization (moeserve/kernels/fp8.py): the published convention, its round-trip bounds, and the
Triton activation quantizers bitwise against their torch twins (CPU: Triton's interpreter)."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported

import pytest  # noqa: E402

from moeserve.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE,
    dequantize_block_fp8,
    quantize_block_fp8,
    quantize_groups_fp8,
    quantize_groups_fp8_ref,
    silu_mul_quant_fp8,
    silu_mul_quant_fp8_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# every e4m3fn value, from its bits (0x7f / 0xff are NaN)
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
E4M3_GRID = torch.unique(E4M3_VALUES[~E4M3_VALUES.isnan()])


def _nearest_even_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Independent oracle: the e4m3 grid value nearest to v (|v| <= 448), ties to the even mantissa."""
    grid = E4M3_GRID.double()
    d = (v.double()[..., None] - grid).abs()
    best = d.min(-1).values
    cands = (d == best[..., None])
    # of two equidistant grid values, the one whose code is even (last mantissa bit 0)
    codes = torch.tensor([int(torch.tensor(g, dtype=torch.float32).to(FP8_DTYPE).view(torch.uint8)) for g in
                          E4M3_GRID.tolist()])
    score = cands.double() * 2 + (codes % 2 == 0).double()
    return grid[score.argmax(-1)].float()


def test_torch_cast_rounds_to_nearest_even_and_we_clamp():
    # the convention the helpers rely on: RNE on the e4m3 grid (subnormals included); clamping first keeps
    # out-of-range values finite whatever a cast does there
    v = torch.tensor([1.0625, 1.1875, 200.0, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 447.0, -300.0, 0.3, -0.0011])
    assert torch.equal(v.to(FP8_DTYPE).float(), _nearest_even_e4m3(v))
    assert E4M3_GRID.max().item() == 448.0 and E4M3_GRID[E4M3_GRID > 0].min().item() == 2.0**-9


@pytest.mark.parametrize("shape", [(256, 384), (192, 200), (2, 130, 129), (1, 1)])
def test_block_quant_round_trip_bounds(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 4, shape, generator=gen).float())
    q, s = quantize_block_fp8(w)
    *lead, n, k = shape
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (*lead, -(-n // 128), -(-k // 128))
    # the scale of each block is its amax / 448, partial edge blocks included
    for bi in range(s.shape[-2]):
        for bj in range(s.shape[-1]):
            blk = w[..., bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert torch.equal(s[..., bi, bj], blk.abs().amax(dim=(-2, -1)) / 448)
    back = dequantize_block_fp8(q, s)
    scale = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    err = (back - w).abs()
    # half an ulp of the element's binade (<= 2^-4 of it), 2^-10 of the scale below the normal range; fp32 slack
    assert (err <= 2.0**-4 * w.abs() + 2.0**-10 * scale + 1e-6 * w.abs()).all()
    # in block units: half an ulp of the top binade, 16 * scale_inv = amax / 28
    assert (err <= 16 * scale * (1 + 1e-6)).all()
    # the largest element maps to 448, on the grid: back within fp32 rounding of (amax / 448) * 448
    assert torch.isclose(back.abs().amax(), w.abs().amax(), rtol=1e-6)
    # q is the nearest-even e4m3 value of w / scale
    ref = _nearest_even_e4m3((w / torch.where(scale > 0, scale, 1)).clamp(-448, 448)[..., :64, :64])
    assert torch.equal(q.float()[..., :64, :64], ref)


def test_block_quant_zero_blocks_and_fused_3d():
    w = torch.randn(3, 256, 256)
    w[1] = 0
    w[0, :128, 128:] = 0
    q, s = quantize_block_fp8(w)
    assert s[1].eq(0).all() and s[0, 0, 1] == 0 and s[0, 1, 0] > 0
    back = dequantize_block_fp8(q, s)
    assert torch.isfinite(back).all() and back[1].eq(0).all() and back[0, :128, 128:].eq(0).all()
    # per-expert quantization of a fused 3-D stack equals quantizing each expert alone
    for e in range(3):
        qe, se = quantize_block_fp8(w[e])
        assert torch.equal(qe.view(torch.uint8), q[e].view(torch.uint8)) and torch.equal(se, s[e])


def test_dequantize_rejects_a_scale_of_the_wrong_shape():
    q, s = quantize_block_fp8(torch.randn(256, 192))
    with pytest.raises(ValueError, match="scale_inv"):
        dequantize_block_fp8(q, s[:, :1])


def _bitwise(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale_m_major", [False, True])
@pytest.mark.parametrize("m,k,group", [(5, 256, 128), (3, 200, 128), (17, 96, 32)])
def test_group_quant_kernel_is_its_twin(m, k, group, scale_m_major):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-14, 6, (m, k), generator=gen).float())
    x[0] = 0  # an all-zero row: scale 0, zeros
    x[1, :7] = torch.tensor([1e4, -1e4, 2.0**-10, 1.5 * 2.0**-10, 1.0625, -1.1875, 0.0])
    q, s = quantize_groups_fp8(x.to(DEV), group, scale_m_major=scale_m_major)
    qr, sr = quantize_groups_fp8_ref(x, group)
    assert s.shape == (m, -(-k // group))
    assert s.stride() == ((1, m) if scale_m_major else (s.shape[1], 1))  # M-major: as torch._scaled_mm takes it
    assert torch.equal(s.cpu(), sr) and _bitwise(q.cpu(), qr)
    assert s[0].eq(0).all() and q[0].float().eq(0).all()


def test_group_quant_of_bf16():
    x = torch.randn(9, 384, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q, s = quantize_groups_fp8(x.to(DEV))
    qr, sr = quantize_groups_fp8_ref(x)
    assert torch.equal(s.cpu(), sr) and _bitwise(q.cpu(), qr)


def test_silu_mul_quant_kernel_matches_its_twin():
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(7, 2 * 192, generator=gen) * 3
    q, s = silu_mul_quant_fp8(gu.to(DEV))
    qr, sr = silu_mul_quant_fp8_ref(gu)
    assert q.shape == (7, 192) and s.shape == (7, 2)
    # exp may differ in the last fp32 bit between Triton and torch: scales within 1 ulp, values within one e4m3
    # step, and nearly all bitwise
    assert torch.allclose(s.cpu(), sr, rtol=2e-7, atol=0)
    diff = (q.cpu().float() - qr.float()).abs()
    assert (diff <= 2.0**-3 * qr.float().abs() + 2.0**-9).all()
    assert (q.cpu().view(torch.uint8) != qr.view(torch.uint8)).float().mean() < 0.01


def test_silu_mul_quant_with_h_returns_the_values_it_quantized():
    """with_h (the LoRA down shrink's input): h is silu(g) * u rounded to gu's dtype, as the twin rounds it, and
    quantizing that h per group gives back the kernel's own fp8 values and scales bitwise."""
    gen = torch.Generator().manual_seed(5)
    gu = (torch.randn(9, 2 * 256, generator=gen) * 3).to(torch.float16)
    q, s, h = silu_mul_quant_fp8(gu.to(DEV), with_h=True)
    q0, s0 = silu_mul_quant_fp8(gu.to(DEV))
    assert h.dtype == torch.float16 and h.shape == (9, 256)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    g, u = gu[:, :256].float(), gu[:, 256:].float()
    ref = (torch.nn.functional.silu(g) * u).to(torch.float16)
    # exp may differ in the last fp32 bit: h within one fp16 ulp of the torch value
    assert torch.allclose(h.cpu().float(), ref.float(), rtol=2.0**-10, atol=2.0**-24)
    qh, sh = quantize_groups_fp8(h)
    assert torch.equal(qh.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sh, s)


@pytest.mark.gpu
@gpu
def test_group_quant_kernel_bitwise_on_gpu_at_model_shapes():
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(4096, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_groups_fp8(x)
    qr, sr = quantize_groups_fp8_ref(x)
    assert torch.equal(s, sr) and _bitwise(q, qr)
    gu = torch.randn(4096 * 8, 2 * 768, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, s = silu_mul_quant_fp8(gu)
    qr, sr = silu_mul_quant_fp8_ref(gu)
    assert torch.allclose(s, sr, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean() < 1e-3
