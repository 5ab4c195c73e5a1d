"""RMSNorm, computed in fp32 like the HF reference, then cast back; optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: str = "torch", pdl: bool = False):
        """backend "triton": one fused kernel per call (kernels/norm_rotary.py), launched with programmatic dependent
        launch when `pdl` (kernels/pdl.py); "torch": the reference."""
        super().__init__()
        self.pdl = pdl
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.kernels = None  # the Triton kernels module, imported only when chosen
        if backend == "triton":
            from moeserve.kernels import norm_rotary

            self.kernels = norm_rotary

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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
