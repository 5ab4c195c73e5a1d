"""Probe: does PDL (programmatic dependent launch) shorten a CUDA-graph chain of small Triton kernels on this GPU?"""
import sys, torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

@triton.jit
def norm_k(x_ptr, w_ptr, o_ptr, N: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    o = tl.arange(0, N)
    x = tl.load(x_ptr + r * N + o).to(tl.float32)
    w = tl.load(w_ptr + o).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + 1e-6) * w
    tl.store(o_ptr + r * N + o, y.to(o_ptr.dtype.element_ty))

@triton.jit
def gemv_k(x_ptr, w_ptr, o_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr,
           PREFETCH: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    if PREFETCH:
        w0 = tl.load(w_ptr + n[:, None] * K + k[None, :])
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BN,), tl.float32)
    for k0 in tl.static_range(0, K, BK):
        if PREFETCH and k0 == 0:
            w = w0
        else:
            w = tl.load(w_ptr + n[:, None] * K + (k0 + k)[None, :])
        x = tl.load(x_ptr + k0 + k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(o_ptr + n, acc.to(o_ptr.dtype.element_ty))

def main():
    dev = torch.device("cuda"); bf = torch.bfloat16; L = 48
    H, Q, O = 2048, 5120, 4096
    torch.manual_seed(0)
    ws = [(torch.randn(H, device=dev, dtype=bf), torch.randn(Q, H, device=dev, dtype=bf) * 0.02,
           torch.randn(H, device=dev, dtype=bf), torch.randn(H, O, device=dev, dtype=bf) * 0.02) for _ in range(L)]
    x0 = torch.randn(1, H, device=dev, dtype=bf)
    bufs = [torch.empty(1, H, device=dev, dtype=bf), torch.empty(Q, device=dev, dtype=bf),
            torch.empty(1, H, device=dev, dtype=bf), torch.empty(H, device=dev, dtype=bf)]
    def step(pdl, pre):
        x = x0
        for nw, wq, nw2, wo in ws:
            norm_k[(1,)](x, nw, bufs[0], N=H, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
            gemv_k[(Q // 16,)](bufs[0], wq, bufs[1], Q, K=H, BN=16, BK=256, USE_PDL=pdl, PREFETCH=pre, num_warps=4, launch_pdl=pdl)
            norm_k[(1,)](bufs[1], nw2, bufs[2], N=H, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)  # first H of q
            gemv_k[(H // 16,)](bufs[1], wo, bufs[3], H, K=O, BN=16, BK=256, USE_PDL=pdl, PREFETCH=pre, num_warps=4, launch_pdl=pdl)
            x = bufs[3].view(1, H)
        return bufs[3].clone()
    res = {}
    graphs = {}
    for mode in [(False, False), (True, False), (True, True), (False, True)]:
        out = step(*mode); torch.cuda.synchronize()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(*mode)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = step(*mode)
        g.replay(); torch.cuda.synchronize()
        graphs[mode] = (g, gout, out)
    ref = graphs[(False, False)][2]
    for mode, (g, gout, out) in graphs.items():
        print(mode, "eager==ref", torch.equal(out, ref), "graph==ref", torch.equal(gout, ref))
    times = {m: [] for m in graphs}
    for rep in range(7):
        for m, (g, _, _) in graphs.items():
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(20):
                g.replay()
            en.record(); torch.cuda.synchronize()
            times[m].append(st.elapsed_time(en) / 20 * 1000)
    for m, t in times.items():
        t.sort()
        print(f"pdl={m[0]} prefetch={m[1]}: median {t[3]:.1f} us per {L}x4 kernels = {t[3]/(4*L):.2f} us/kernel")

main()
