"""Routed-expert MoE block (router, top-k, experts, optional qwen2 shared expert) and dense MLP.

Expert weights live fused: w13 [E, 2I, H] (rows [:I] gate, [I:] up), w2 [E, H, I].
Expert LoRA buffers (per slot, per expert) come from the slot pool; the deltas go where
the math puts them: gate_up delta before the activation, down delta (times the routing
weight) before the top-k sum. The router and the qwen2 shared-expert gate are LoRALinears,
so a router LoRA (PEFT `all-linear`) changes the logits before softmax and top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve import module_tree
from moeserve.exec_options import TORCH_CPU, ExecOptions
from moeserve.layers import cpu_linear
from moeserve.layers.backends import kernels
from moeserve.layers.linear import LoRALinear
from moeserve.layers.weight_formats import weight_method
from moeserve.model_spec import ModelSpec
from moeserve.layers.batch import LoRABatch


@dataclass
class ExpertLoRABuffers:
    gate_up_a: torch.Tensor  # [L, E, R, H]: A of the gate rows, and of the up rows where the slot has one A
    gate_up_b: torch.Tensor  # [L, E, 2I, R]
    down_a: torch.Tensor  # [L, E, R, I]
    down_b: torch.Tensor  # [L, E, H, R]
    # only with lora_separate_gate_up: the up rows' own A, read for slots whose flag is 1 (an adapter with
    # separate gate and up LoRAs, each of rank r); a slot with flag 0 never reads up_a
    up_a: torch.Tensor | None = None  # [L, E, R, H]
    gate_up_separate: torch.Tensor | None = None  # [L] int32


def _lora_delta(inp, a, b, token_slots, slots):
    """Sum over slots of masked x A^T B^T; rows of other slots get exact zeros."""
    delta = None
    for slot in (range(a.shape[0]) if slots is None else slots):
        d = (inp @ a[slot].t()) @ b[slot].t()
        d = torch.where((token_slots == slot).unsqueeze(-1), d, torch.zeros_like(d))
        delta = d if delta is None else delta + d
    return delta


def moe_experts_torch(x, w13, w2, topk_weights, topk_ids, lora: LoRABatch | None,
                      lora_bufs: ExpertLoRABuffers | None, packed: PackedExperts | None = None) -> torch.Tensor:
    """Reference experts. On the CPU each expert runs over the rows routed to it only (through `packed`
    where given); elsewhere (a CUDA graph cannot hold the routed path's host sync) every expert runs densely
    over every row."""
    if x.device.type == "cpu":
        return moe_experts_routed(x, w13, w2, topk_weights, topk_ids, lora, lora_bufs, packed)
    return moe_experts_dense(x, w13, w2, topk_weights, topk_ids, lora, lora_bufs)


@dataclass
class PackedExperts:
    """Each expert's w13 and w2 packed for oneDNN (layers/cpu_linear.py: about 2x MKL at decode sizes)."""
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]

    @staticmethod
    def of(w13, w2) -> PackedExperts | None:
        if not (cpu_linear.packable(w13[0]) and cpu_linear.packable(w2[0])):
            return None
        return PackedExperts([cpu_linear.pack(w) for w in w13], [cpu_linear.pack(w) for w in w2])


# Rows go through an expert's matmuls in blocks padded with zero rows to a multiple of this. CPU GEMMs pick
# their kernel by the number of rows (MKL: 1, 2-3, >= 4 rows and, split over threads, uneven remainders;
# oneDNN: 1 and >= 2 rows), and the kernels round differently, so a row's result would depend on how many
# other rows share its expert. Padded, every row takes the same kernel whatever the others are
# (tests/test_cpu_experts.py); 4 rows is also oneDNN's fastest decode size here.
ROW_BLOCK = 4


def _expert_linear(x, w, packed):
    """x [a multiple of ROW_BLOCK rows, in] @ w.T: in one call through oneDNN's packed copy (its kernel is the same
    from 2 rows on), else ROW_BLOCK rows a call, since MKL's kernel, and its rounding, changes further with the row
    count (on an AVX-512 CPU 8 rows of a [64, 96] weight round differently from 4, and 16 of a [576, 1536] from 12)."""
    if packed is not None and x.dtype == torch.float32:
        return cpu_linear.linear(x, w, packed)
    return torch.cat([cpu_linear.linear(block, w, None) for block in x.split(ROW_BLOCK)])


def _pad_rows(t, n):
    return t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


def moe_experts_routed(x, w13, w2, topk_weights, topk_ids, lora: LoRABatch | None,
                       lora_bufs: ExpertLoRABuffers | None, packed: PackedExperts | None = None) -> torch.Tensor:
    """Each expert over the rows routed to it (gathered, padded to a multiple of ROW_BLOCK), its output times
    the routing weight added to those rows in expert order, as the dense loop adds them. One host sync (rows
    per expert). Expert ids outside [0, E) (another rank's, under expert parallelism) are skipped."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (row, k) pairs by expert, rows ascending within one
    rows_all = order // topk_ids.shape[1]
    weights_all = topk_weights.flatten()[order]
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    use_lora = lora is not None and lora_bufs is not None
    b = lora_bufs
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = rows_all[start:start + n]
        weight = weights_all[start:start + n].unsqueeze(-1)
        start += n
        padded = -(-n // ROW_BLOCK) * ROW_BLOCK
        xe = _pad_rows(x.index_select(0, rows), padded)
        gu = _expert_linear(xe, w13[e], packed.w13[e] if packed else None)
        if use_lora:
            slots = _pad_rows(lora.token_slots.index_select(0, rows), padded)
            slots[n:] = -1
            has_adapter = (slots >= 0).unsqueeze(-1)
            xa = xe.to(b.gate_up_a.dtype)
            if b.up_a is None:
                d = _lora_delta(xa, b.gate_up_a[:, e], b.gate_up_b[:, e], slots, lora.active_slots)
            else:  # up rows: each slot's own up A where it has one (flag 1), its one A otherwise
                up_a = torch.where(b.gate_up_separate.view(-1, 1, 1) != 0, b.up_a[:, e], b.gate_up_a[:, e])
                d = torch.cat([
                    _lora_delta(xa, b.gate_up_a[:, e], b.gate_up_b[:, e, :inter], slots, lora.active_slots),
                    _lora_delta(xa, up_a, b.gate_up_b[:, e, inter:], slots, lora.active_slots)], dim=-1)
            gu = torch.where(has_adapter, gu + d.to(gu.dtype), gu)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = _expert_linear(h, w2[e], packed.w2[e] if packed else None)
        if use_lora:
            d = _lora_delta(h.to(b.down_a.dtype), b.down_a[:, e], b.down_b[:, e], slots, lora.active_slots)
            y = torch.where(has_adapter, y + d.to(y.dtype), y)
        out.index_add_(0, rows, y[:n] * weight.to(y.dtype))
    return out


def moe_experts_dense(x, w13, w2, topk_weights, topk_ids, lora: LoRABatch | None,
                      lora_bufs: ExpertLoRABuffers | None) -> torch.Tensor:
    """Every expert applied densely to every row and weighted by the routing weight (0 where not routed).
    Sync-free, so it can be captured in a CUDA graph; expert order matches the HF reference sum. Rows without
    an adapter take `where(False, ...)`, so they stay bitwise the no-LoRA result."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    use_lora = lora is not None and lora_bufs is not None
    if use_lora:
        has_adapter = (lora.token_slots >= 0).unsqueeze(-1)
        b = lora_bufs
    for e in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == e)).sum(dim=-1, keepdim=True)  # [T, 1]
        gu = x @ w13[e].t()
        if use_lora:
            xa = x.to(b.gate_up_a.dtype)
            if b.up_a is None:
                d = _lora_delta(xa, b.gate_up_a[:, e], b.gate_up_b[:, e], lora.token_slots, lora.active_slots)
            else:  # up rows: each slot's own up A where it has one (flag 1), its one A otherwise
                up_a = torch.where(b.gate_up_separate.view(-1, 1, 1) != 0, b.up_a[:, e], b.gate_up_a[:, e])
                d = torch.cat([
                    _lora_delta(xa, b.gate_up_a[:, e], b.gate_up_b[:, e, :inter], lora.token_slots, lora.active_slots),
                    _lora_delta(xa, up_a, b.gate_up_b[:, e, inter:], lora.token_slots, lora.active_slots)], dim=-1)
            gu = torch.where(has_adapter, gu + d.to(gu.dtype), gu)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w2[e].t()
        if use_lora:
            d = _lora_delta(h.to(b.down_a.dtype), b.down_a[:, e], b.down_b[:, e], lora.token_slots, lora.active_slots)
            y = torch.where(has_adapter, y + d.to(y.dtype), y)
        out = out + y * weight.to(y.dtype)
    return out


class DenseMLP(nn.Module):
    """SiLU-gated MLP (dense layers and the qwen2 shared expert)."""

    def __init__(self, hidden: int, inter: int, options: ExecOptions = TORCH_CPU, prefix: str = "mlp"):
        """`prefix`: the module's checkpoint name ("model.layers.1.mlp"), for options.weight_format."""
        super().__init__()
        self.inter = inter
        self.gate_up_proj = LoRALinear(hidden, (inter, inter), False, options,
                                       weights=options.weight_format(f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        self.down_proj = LoRALinear(inter, (hidden,), False, options, weights=options.weight_format(f"{prefix}.down_proj"))

    def forward(self, x, lora: LoRABatch | None):
        gu = self.gate_up_proj(x, lora)
        return self.down_proj(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], lora)


class MoEBlock(nn.Module):
    """`options` (exec_options.py): the MoE backend (routing and experts), the shared expert's linear backend (the
    router and the shared-expert gate keep cuBLAS), the LoRA backend, PDL. `gemm_topk_max_tokens` (triton
    backend): batches of at most this many tokens run the router GEMM inside the routing kernel; larger ones run
    the linear layer, then the routing kernel.

    `prefix`: the block's checkpoint name ("model.layers.0.mlp"), for options.weight_format of the routed experts and
    the shared expert (the router and the shared-expert gate are stored as they are). FP8 experts
    (layers/weight_formats.py): w13 / w2 float8_e4m3fn with w13_scale_inv / w2_scale_inv, multiplied by
    kernels/fused_moe_fp8 on the triton backend, dequantized on the torch one."""

    def __init__(self, spec: ModelSpec, options: ExecOptions = TORCH_CPU, gemm_topk_max_tokens: int | None = None,
                 prefix: str = "mlp"):
        super().__init__()
        self.spec = spec
        self.pdl = options.pdl
        E, H, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.router = LoRALinear(H, (E,), False, options, gemv=False)
        # the block's checkpoint name is `mlp` or (Mixtral) `block_sparse_moe`: either may be named unconverted
        layer = prefix.rpartition(".")[0]
        names = [f"{layer}.{block}.experts" for block in module_tree.MOE_BLOCKS] if layer else [f"{prefix}.experts"]
        self.weights = weight_method(options.weight_format(*names))
        self.weights.create(self, "w13", (E, 2 * inter, H), (inter, inter), experts=True)
        self.weights.create(self, "w2", (E, H, inter), (H,), experts=True)
        self.lora_bufs: ExpertLoRABuffers | None = None  # set by the slot pool
        self._packed: tuple[tuple, PackedExperts | None] | None = None  # (weights' identity, packed), torch CPU
        self.shared_expert = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(H, spec.shared_expert_intermediate_size, options,
                                          prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = LoRALinear(H, (1,), False, options, gemv=False)
        self._fused = kernels("moe", options.moe_backend)
        self._routing = router_kernels = kernels("routing", options.moe_backend)  # router GEMM + softmax + top-k
        if router_kernels is not None:
            if gemm_topk_max_tokens is None:
                gemm_topk_max_tokens = router_kernels.GEMM_TOPK_MAX_TOKENS
            self.gemm_topk_max_tokens = gemm_topk_max_tokens
            # arrival counters of the fused router GEMM: zero between launches (each launch resets them)
            self.register_buffer("router_counters", torch.zeros(
                router_kernels.counter_slots(max(gemm_topk_max_tokens, 1)), dtype=torch.int32), persistent=False)

    def _packed_experts(self, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> PackedExperts | None:
        """The experts (w13, w2: the parameters, or their dequantized copies for FP8) packed for the CPU path, made at
        the first forward and again when the weights change (cpu_linear.identity; the loader writes them before the
        first forward)."""
        if w13 is None:
            w13, w2 = self.w13, self.w2
        if w13.device.type != "cpu":
            return None
        key = cpu_linear.identity(w13, w2)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, PackedExperts.of(w13, w2))
        return self._packed[1]

    def route(self, x, lora: LoRABatch | None):
        """(top-k weights [T, K], expert ids [T, K]) over all experts, best first."""
        if self._routing is not None:
            return self._route_fused(x, lora)
        logits = self.router(x, lora)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        topk_w, topk_ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        if not self.spec.router_weights_fp32:
            topk_w = topk_w.to(x.dtype)
        return topk_w, topk_ids

    def _route_fused(self, x, lora: LoRABatch | None):
        """One routing kernel; at decode sizes it also runs the router GEMM. A router LoRA's delta is computed
        first and added inside the kernel, so rows without an adapter get the same logits as in a no-LoRA
        batch (bitwise), and the choice of path depends on the token count only."""
        k, renorm = self.spec.top_k, self.spec.norm_topk_prob
        out_dtype = torch.float32 if self.spec.router_weights_fp32 else x.dtype
        if x.shape[0] > self.gemm_topk_max_tokens:
            return self._routing.fused_topk(self.router(x, lora), k, renorm, out_dtype, pdl=self.pdl)
        delta = None
        if lora is not None and self.router.lora_a is not None:
            delta = torch.zeros(x.shape[0], self.router.out_features, dtype=x.dtype, device=x.device)
            self.router.add_lora(x, lora, delta)
        return self._routing.fused_gemm_topk(x, self.router.weight, k, renorm, out_dtype, delta,
                                             counters=self.router_counters, pdl=self.pdl)

    def input_quant(self, x: torch.Tensor) -> tuple[int, bool] | None:
        """(group, scale_m_major) in which the FP8 experts read a batch like `x` quantized (W8A8 on the triton
        backend; row-major scales), so the norm that makes x can write that copy too; None where they read x as it
        is (LoRALinear.input_quant's answer for a dense projection)."""
        if not (self.weights.quantized and self._fused is not None):
            return None
        from moeserve.kernels import fused_moe_fp8

        group = fused_moe_fp8.input_quant_group(x, self.w13, self.w2, self.spec.top_k, self.weights.format.act_quant)
        return (group, False) if group else None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None, x_fp8=None) -> torch.Tensor:
        """`x_fp8`: x quantized as input_quant says, by the norm that made x."""
        topk_w, topk_ids = self.route(x, lora)
        return self.experts(x, topk_w, topk_ids, lora, x_fp8)

    def experts(self, x, topk_w, topk_ids, lora: LoRABatch | None, x_fp8=None) -> torch.Tensor:
        """The routed experts (and the shared expert) for routing already decided."""
        use_lora = lora is not None and self.lora_bufs is not None
        if self.weights.quantized:
            out = self._fp8_experts(x, topk_w, topk_ids, lora if use_lora else None, x_fp8)
        elif self._fused is not None:
            args = None
            if use_lora:
                b = self.lora_bufs
                args = self._fused.MoELoRAArgs(lora.token_slots, lora.slot_ranks, b.gate_up_a, b.gate_up_b, b.down_a,
                                               b.down_b, b.up_a, b.gate_up_separate)
            out = self._fused.fused_moe(x, self.w13, self.w2, topk_w, topk_ids, lora=args, pdl=self.pdl)
        else:
            out = moe_experts_torch(x, self.w13, self.w2, topk_w, topk_ids, lora, self.lora_bufs if use_lora else None,
                                    self._packed_experts())
        if self.shared_expert is not None:
            shared = self.shared_expert(x, lora)
            out = out + torch.sigmoid(self.shared_expert_gate(x, lora)) * shared
        return out

    def _fp8_experts(self, x, topk_w, topk_ids, lora: LoRABatch | None, x_fp8=None) -> torch.Tensor:
        """The routed experts on FP8 weights. Triton: kernels/fused_moe_fp8 (the LoRA, where the batch has one: its
        shrinks on the unquantized x and h, its expands in the FP8 GEMMs' epilogues, a row without an adapter as
        without it); torch: the dequantized weights through the plain path (its LoRA as the bf16 one's)."""
        act_quant = self.weights.format.act_quant
        if self._fused is not None:
            from moeserve.kernels import fused_moe_fp8

            args = None
            if lora is not None:
                b = self.lora_bufs
                args = self._fused.MoELoRAArgs(lora.token_slots, lora.slot_ranks, b.gate_up_a, b.gate_up_b, b.down_a,
                                               b.down_b, b.up_a, b.gate_up_separate)
            return fused_moe_fp8.fused_moe_fp8(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, topk_w,
                                               topk_ids, act_quant=act_quant, lora=args, pdl=self.pdl,
                                               x_fp8=x_fp8)
        if act_quant:
            from moeserve.kernels.fused_moe_fp8 import fused_moe_fp8_ref

            if lora is not None:
                raise NotImplementedError("W8A8 experts with LoRA on the torch MoE backend")
            return fused_moe_fp8_ref(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, topk_w, topk_ids,
                                     act_quant=True).to(x.dtype)
        w13 = self.weights.dequantized(self, "w13", x.dtype)
        w2 = self.weights.dequantized(self, "w2", x.dtype)
        return moe_experts_torch(x, w13, w2, topk_w, topk_ids, lora, self.lora_bufs if lora is not None else None,
                                 self._packed_experts(w13, w2))
