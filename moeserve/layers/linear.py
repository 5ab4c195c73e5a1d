"""Linear projections that can carry multi-LoRA deltas.

A projection may be fused (q|k|v, gate|up): `slice_sizes` names its output slices, each of
which may have its own LoRA. The LoRA buffers (`lora_a [L, S, R, in]`, `lora_b [L, N, R]`)
are allocated once by the slot pool and never move; slots are filled in place.
"""
from __future__ import annotations

import torch
from torch import nn

from moeserve.exec_options import PLAIN_WEIGHTS, TORCH_CPU, ExecOptions, WeightFormat
from moeserve.layers import cpu_linear
from moeserve.layers.backends import kernels
from moeserve.layers.batch import LoRABatch
from moeserve.layers.weight_formats import weight_method


def dense_lora_torch(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, slots=None) -> None:
    """Plain-torch multi-LoRA: out[t, slice i] += (x[t] A_i[s]^T) B_i[s]^T for s = token_slots[t] >= 0.

    Sync-free and shape-static (loops over the static slot count, or the host-known `slots` of an
    eager batch); rows without an adapter are left bitwise untouched. Zero rank columns contribute
    exact zeros, so slot_ranks is not needed.
    """
    num_slots, num_slices, rank, in_dim = lora_a.shape
    x = x.to(lora_a.dtype)
    for slot in (range(num_slots) if slots is None else slots):
        shrink = x @ lora_a[slot].reshape(num_slices * rank, in_dim).t()  # [T, S*R]
        parts, off = [], 0
        for i, n in enumerate(slice_sizes):
            parts.append(shrink[:, i * rank:(i + 1) * rank] @ lora_b[slot, off:off + n].t())
            off += n
        delta = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        mask = (token_slots == slot).unsqueeze(-1)
        out.copy_(torch.where(mask, out + delta.to(out.dtype), out))


class LoRALinear(nn.Module):
    """y = x W^T (+ b) (+ per-token LoRA delta when the batch carries LoRA and this layer has slots).

    `options.linear_backend` "triton" (and `gemv`: the router and the shared-expert gate pass False and keep
    cuBLAS): batches the Triton GEMV serves (kernels/gemv.serves: one row, or two where in > out) run it instead
    of cuBLAS, with the triton LoRA backend's expand fused into it. The choice depends on the row count, the
    shape and the options only, never on LoRA, so the LoRA and no-LoRA variants (eager or graph) share one base
    path.

    `weights`: how the base weight is stored (options.weight_format of the module's checkpoint names; plain by
    default). FP8 (layers/weight_formats.py): the base product is kernels/fp8_linear on the linear backend
    "triton", the dequantized weight elsewhere; the LoRA shrink reads x as it came (never an fp8 copy), and rows
    without an adapter get the base product untouched. At 1-2 weight-only rows the expand rides in the FP8
    product's epilogue as in the bf16 GEMV's (weight_formats.fuses_lora); elsewhere the dense LoRA kernels add it."""

    def __init__(self, in_features: int, slice_sizes: tuple[int, ...], bias: bool,
                 options: ExecOptions = TORCH_CPU, gemv: bool = True, weights: WeightFormat = PLAIN_WEIGHTS):
        super().__init__()
        self.pdl = options.pdl  # Triton launches with programmatic dependent launch (kernels/pdl.py)
        self.in_features = in_features
        self.slice_sizes = tuple(slice_sizes)
        self.out_features = sum(slice_sizes)
        self.weights = weight_method(weights)
        self.weights.create(self, "weight", (self.out_features, in_features), self.slice_sizes)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.lora_a: torch.Tensor | None = None  # [L, S, R, in], set by the slot pool
        self.lora_b: torch.Tensor | None = None  # [L, N, R]
        self.packed = cpu_linear.PackedWeight()  # float32 on the CPU: the weight packed for oneDNN
        self.lora_kernels = kernels("lora", options.lora_backend)
        self.use_triton = self.lora_kernels is not None
        self.gemv_kernels = kernels("linear", options.linear_backend) if gemv else None
        if self.weights.quantized:
            self.gemv_kernels = None  # the GEMV reads plain weights; FP8 runs fp8_linear at every size
            self.fp8_backend = "triton" if options.linear_backend == "triton" else "torch"
        # the LoRA shrink beside the GEMM where the batch has a side stream (options.lora_side_stream; by default
        # beside the FP8 GEMM, whose programs leave the shrink room: beside bf16 cuBLAS it lost at batch 256)
        self.shrink_beside = options.lora_side_stream is True or (options.lora_side_stream is None
                                                                  and self.weights.quantized)

    def input_quant(self, x: torch.Tensor) -> tuple[int, bool] | None:
        """(group, scale_m_major) in which the FP8 product reads a batch like x quantized, so the norm that makes x
        can write that copy (`forward`'s `x_fp8`); None where it reads x as it is (and for plain weights)."""
        return self.weights.input_quant(self, x, self.fp8_backend) if self.weights.quantized else None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8=None) -> torch.Tensor:
        """`x_fp8`: x quantized as input_quant says, by the kernel that wrote x (the LoRA still reads x itself)."""
        with_lora = lora is not None and self.lora_a is not None
        if self.weights.quantized:
            if with_lora and self.use_triton and self.weights.fuses_lora(x.shape[0], self.fp8_backend):
                return self.weights.linear(self, x, self.fp8_backend, self.pdl, lora=self._epilogue_lora(x, lora))
            base = lambda: self.weights.linear(self, x, self.fp8_backend, self.pdl, x_fp8=x_fp8)  # noqa: E731
        elif self.gemv_kernels is not None and self.gemv_kernels.serves(x.shape[0], self.out_features,
                                                                        self.in_features):
            return self._gemv_forward(x, lora if with_lora else None)
        else:
            base = lambda: cpu_linear.linear(x, self.weight, self.packed.get(self.weight), self.bias)  # noqa: E731
        if with_lora and self.use_triton and self.shrink_beside and lora.side_stream is not None:
            return self._beside_shrink(x, lora, base)
        y = base()
        if with_lora:
            self.add_lora(x, lora, y)
        return y

    def _beside_shrink(self, x: torch.Tensor, lora: LoRABatch, base) -> torch.Tensor:
        """The base product (`base()`, on the current stream) with the LoRA shrink on lora.side_stream at the same
        time, then the expand into it: the shrink reads only x, and the GEMM launched by torch takes no part in
        programmatic dependent launch, so in line it would run after the GEMM, each waiting for the other. Forked
        and joined by stream waits (captured into a graph as two branches); neither LoRA launch uses PDL, each
        following a cross-stream wait. x and the scratch are both allocated on the current stream and freed only
        after it has waited for the side stream, so no block is handed out again while the shrink may read it."""
        main = torch.cuda.current_stream(x.device)
        lora.side_stream.wait_stream(main)  # x written
        scratch = self.lora_kernels.dense_lora_shrink(x, self.lora_a, lora.token_slots, lora.slot_ranks,
                                                      lora.dense_groups, stream=lora.side_stream)
        y = base()
        main.wait_stream(lora.side_stream)
        self.lora_kernels.dense_lora_expand(scratch, self.lora_b, lora.slot_ranks, lora.dense_groups,
                                            self.slice_sizes, y)
        return y

    def _gemv_forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        if lora is None:
            return self.gemv_kernels.gemv(x, self.weight, self.bias, pdl=self.pdl)
        if not self.use_triton:
            y = self.gemv_kernels.gemv(x, self.weight, self.bias, pdl=self.pdl)
            self.add_lora(x, lora, y)
            return y
        return self.gemv_kernels.gemv(x, self.weight, self.bias, lora=self._epilogue_lora(x, lora), pdl=self.pdl)

    def _epilogue_lora(self, x: torch.Tensor, lora: LoRABatch):
        """Launches the shrink alone and returns the expand a decode-row kernel adds in its epilogue (the bf16
        GEMV, or the FP8 product): the kernel launched next, so its K walk runs under the shrink."""
        scratch = self.lora_kernels.dense_lora_shrink(x, self.lora_a, lora.token_slots, lora.slot_ranks,
                                                      lora.dense_groups, pdl=self.pdl)
        gemv_kernels = self.gemv_kernels or kernels("linear", "triton")  # FP8 modules keep no GEMV of their own
        return gemv_kernels.GemvLoRA(scratch, self.lora_b, lora.token_slots, lora.slot_ranks, self.slice_sizes)

    def add_lora(self, x: torch.Tensor, lora: LoRABatch, out: torch.Tensor) -> None:
        """out += each row's adapter delta (rows without an adapter untouched); needs the slot pool's buffers."""
        args = (x, self.lora_a, self.lora_b, lora.token_slots, lora.slot_ranks, self.slice_sizes, out)
        if self.use_triton:
            self.lora_kernels.dense_lora(*args, groups=lora.dense_groups, pdl=self.pdl)
        else:
            dense_lora_torch(*args, slots=lora.active_slots)
