"""Where the GPU group quantizer and its torch twin disagree (tests/test_kernels_fp8_quant.py's GPU test failed in
session 12, call 1, with equal scales): the differing elements with their input, scale, exact quotient and both
fp8 values."""
import torch

from moeserve.kernels.fp8 import quantize_groups_fp8, quantize_groups_fp8_ref

gen = torch.Generator(device="cuda").manual_seed(4)
x = torch.randn(4096, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
q, s = quantize_groups_fp8(x)
qr, sr = quantize_groups_fp8_ref(x)
diff = (q.view(torch.uint8) != qr.view(torch.uint8)).nonzero()
print(f"scales equal {torch.equal(s, sr)}; {diff.shape[0]} of {q.numel()} elements differ")
xs = x.float().cpu()
for r, c in diff[:12].tolist():
    sc = s[r, c // 128].item()
    quot_gpu = (x[r, c].float() / s[r, c // 128]).item()
    quot_cpu = (xs[r, c] / sr[r, c // 128].cpu()).item()
    print(f"[{r},{c}] x={xs[r, c].item():.8e} scale={sc:.8e} x/s gpu={quot_gpu:.9e} cpu={quot_cpu:.9e} "
          f"kernel={q[r, c].float().item()} ({q.view(torch.uint8)[r, c].item():#04x}) "
          f"twin={qr[r, c].float().item()} ({qr.view(torch.uint8)[r, c].item():#04x}) "
          f"cpu twin={quantize_groups_fp8_ref(xs[r:r + 1])[0][0, c].float().item()}")
