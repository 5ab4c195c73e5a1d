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
        """Whether `norm_fp8` can make the FP8 copy in the norm's own launch (the triton norm backend)."""
        return self.kernels is not None

    def norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, group: int, scale_m_major: bool = False):
        """forward(x, residual)'s normed rows (and sum: None without a residual) and the normed rows quantized per
        `group` columns for a W8A8 consumer, (q, scale), in one launch; bitwise the quantization kernel run on the
        normed rows (`scale_m_major`: the scale's layout for cuBLAS)."""
        return self.kernels.rms_norm_fp8(x, residual, self.weight, self.eps, group, scale_m_major, pdl=self.pdl)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
