"""RMSNorm, computed in fp32 like the HF reference, then cast back; optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from moeserve.exec_options import ExecOptions
from moeserve.layers.backends import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, options: ExecOptions | None = None):
        """`options.norm_backend` "triton": one fused kernel per call (kernels/norm_rotary.py), launched with
        programmatic dependent launch when `options.pdl` (kernels/pdl.py); "torch", or no options (the q/k norms,
        which the attention prologue fuses or runs on the torch path): the reference."""
        super().__init__()
        self.pdl = options is not None and options.pdl
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.kernels = None if options is None else kernels("norm", options.norm_backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """normed x; with a residual: (normed x + residual, x + residual), the new residual stream."""
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps, pdl=self.pdl)
            return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, pdl=self.pdl)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    @property
    def quantizes(self) -> bool:
        """Whether `forward_fp8` can make the FP8 copy in the norm's own launch (the triton norm backend)."""
        return self.kernels is not None

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, quant: tuple[int, bool] | None):
        """(normed, the residual stream after it: x + residual, or x itself without one, fp8 copy or None). `quant`
        = (group, scale_m_major) asks for the normed rows quantized per `group` columns for a W8A8 consumer, (q,
        scale), made in the norm's own launch (`quantizes`), bitwise the quantization kernel run on the normed rows
        (`scale_m_major`: the scale's layout for cuBLAS); None: the plain norm."""
        if not quant:
            if residual is None:
                return self(x), x, None
            return (*self(x, residual), None)
        h, summed, h_fp8 = self.kernels.rms_norm_fp8(x, residual, self.weight, self.eps, *quant, pdl=self.pdl)
        return h, x if residual is None else summed, h_fp8

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
