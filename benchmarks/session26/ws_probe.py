"""Session 26 probe (#25 prefill): does Triton 3.6's Hopper warp specialization speed a block-scaled W8A8 GEMM?

The shipped W8A8 expert GEMM waits for each K step's QGMMA before scaling its product into the accumulator
(sm_90 build: `WARPGROUP.DEPBAR.LE gsb0, 0x0` after every step's four QGMMA, then 64 FFMA), and at T = 8,192 runs
36 % of the FP8 peak. `tl.range(..., warp_specialize=True)` compiles for sm_90 on a minimal block-scaled GEMM (A
and B through TMA descriptors; our MoE kernel, with gathered A rows and an early return, trips an assertion in the
pass). This times that minimal GEMM with and without it at the expert GEMMs' K and N and a prefill-sized M, and
checks both give the same bits.

    PYTHONPATH=. python benchmarks/session26/ws_probe.py
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _scaled_gemm(a_desc, b_desc, as_ptr, bs_ptr, out_ptr, N, K, stride_out,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    groups = K // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS):
        a = a_desc.load([pid_m * BM, k0])
        b = b_desc.load([pid_n * BN, k0])
        sa = tl.load(as_ptr + rows * groups + k0 // BK)
        sb = tl.load(bs_ptr + (pid_n * BN // 128) * groups + k0 // BK)
        acc += tl.dot(a, b.T) * (sa[:, None] * sb)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(tl.bfloat16))


def run(m, n, k, bm, bn, warps, stages, ws):
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
    sb = torch.rand(n // 128, k // 128, device="cuda", generator=g) + 0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ad = TensorDescriptor.from_tensor(a, [bm, 128])
    bd = TensorDescriptor.from_tensor(b, [bn, 128])

    def call():
        _scaled_gemm[(m // bm, n // bn)](ad, bd, sa, sb, out, n, k, out.stride(0), BM=bm, BN=bn, BK=128, WS=ws,
                                         num_warps=warps, num_stages=stages)
    call()
    ms = triton.testing.do_bench_cudagraph(call, rep=50)
    return ms, out.clone()


def main():
    print(torch.cuda.get_device_name(), triton.__version__)
    for m, n, k in ((8192, 1536, 2048), (8192, 2048, 768), (2048, 1536, 2048)):
        flop = 2 * m * n * k
        for bm, bn, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3)):
            res = {}
            for ws in (False, True):
                try:
                    res[ws] = run(m, n, k, bm, bn, warps, stages, ws)
                except Exception as e:  # noqa: BLE001 (a variant that does not compile is a result too)
                    res[ws] = (float("nan"), None)
                    print(f"  {m}x{n}x{k} {bm}x{bn} w{warps} ws={ws}: {type(e).__name__}: {str(e)[:160]}")
            same = (res[False][1] is not None and res[True][1] is not None
                    and torch.equal(res[False][1], res[True][1]))
            print(f"{m:>5}x{n}x{k:<5} {bm:>3}x{bn:<3} w{warps} s{stages}: plain {res[False][0] * 1e3:7.1f} us "
                  f"({flop / res[False][0] / 1e9:6.0f} TFLOP/s)  ws {res[True][0] * 1e3:7.1f} us "
                  f"({flop / res[True][0] / 1e9:6.0f} TFLOP/s)  same bits {same}", flush=True)


if __name__ == "__main__":
    main()
