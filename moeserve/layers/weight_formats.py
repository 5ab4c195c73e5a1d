"""How a base weight is stored, loaded and multiplied, per weight format (exec_options.WeightFormat): the one place
a quantized format plugs into. A layer asks `weight_method(options.weight_format(names))` once at construction and
keeps the answer (one per module); its hooks:

  create(module, attr, shape, parts,   the parameter(s) holding the weight `attr` of `shape` [..., out, in], its
         experts)                      out rows made of `parts` (a fused module's slices: q|k|v, gate|up);
                                       `experts`: the routed experts' stacked [E, out, in] weights
  load(module, attr, parts, index)     write the checkpoint's parts of the weight: (tensor, scale_inv or None) each,
                                       stacked along out (into module.<attr>[index] for one expert of a 3-D weight);
                                       the loader reads the parts, the tensor-parallel slices included
  dequantized(module, attr, dtype)     the weight in `dtype` (the plain-torch paths multiply that)
  linear(module, x, lora, x_fp8)      a dense module's base product x @ W^T (+ bias); quantized formats only,
                                       with `lora` (where fuses_lora) the adapters' expand added in its epilogue,
                                       with `x_fp8` (where input_quant) x as its producer quantized it

The routed experts' product is the MoE block's (layers/moe.py: the fused kernel of the format, or the plain path on
the dequantized weights), as the plain one is.

Plain ("activation dtype"): the weight in the serving dtype, as before. A checkpoint part stored in FP8 (a module a
checkpoint quantized while the engine keeps it plain) is dequantized at load.

FP8 (block-wise, kernels/fp8.py): `attr` float8_e4m3fn [..., out, in] and `attr_scale_inv` float32 with one value
per block of each part, the parts' block rows stacked ([..., sum ceil(n_i / 128), ceil(in / 128)]), which is how a
checkpoint stores each part and how the fused MoE reads w13 (gate's block rows, then up's). A dense module whose
parts do not all end on a 128-row boundary (the last may) cannot be read as one 128 x 128 grid: its scales are
expanded to one row per weight row (block (1, 128), exact, 1/32 more bytes than the fp8 weight). A plain part (a
bf16 checkpoint under `--quantization fp8`) is quantized at load the way a checkpoint's part is, so the two load to
the same bytes. Tensor parallelism slices the scales with the weight (models/loader.py, distributed/sharding.py).
Multiplied by kernels/fp8_linear (dense, Triton backend) and kernels/fused_moe_fp8 (routed experts); the torch
backend and the CPU dequantize (cached on the CPU, where the weights do not change between steps) and run the
plain paths, the kernels' twins.
"""
from __future__ import annotations

import torch
from torch import nn

from moeserve.exec_options import PLAIN_WEIGHTS, WeightFormat
from moeserve.layers import cpu_linear

FP8_DTYPE = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PlainWeights:
    """The weight in the serving dtype (the model's .to(dtype) casts it)."""

    format = PLAIN_WEIGHTS
    quantized = False

    def create(self, module: nn.Module, attr: str, shape: tuple[int, ...], parts: tuple[int, ...],
               experts: bool = False) -> None:
        setattr(module, attr, nn.Parameter(torch.empty(shape), requires_grad=False))

    def load(self, module: nn.Module, attr: str, parts, index: int | None = None) -> None:
        param = getattr(module, attr)
        value = torch.cat([dequantize_part(t, s, param.dtype) for t, s in parts], dim=-2)
        (param.data if index is None else param.data[index]).copy_(value)

    def dequantized(self, module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor:
        return getattr(module, attr)


class Fp8BlockWeights:
    """Block-wise FP8 weights (see the module docstring)."""

    quantized = True

    def __init__(self, fmt: WeightFormat):
        self.format = fmt
        self.block = tuple(fmt.block)
        # on the CPU, attr -> (what it was made from, the dequantized weight): the weights do not change between
        # steps, so the plain path multiplies one copy (remade when the parameters are replaced)
        self._dequantized: dict[str, tuple] = {}

    def row_block(self, parts: tuple[int, ...], experts: bool) -> int:
        """Rows per scale row: the format's block, or 1 where a dense module's parts break the 128-row grid (the
        fused MoE reads gate's and up's block rows apart, so w13 keeps the block)."""
        bn = self.block[0]
        if experts or all(n % bn == 0 for n in parts[:-1]):
            return bn
        return 1

    def create(self, module: nn.Module, attr: str, shape: tuple[int, ...], parts: tuple[int, ...],
               experts: bool = False) -> None:
        *lead, out, fan_in = shape
        if sum(parts) != out:
            raise ValueError(f"{attr}: parts {parts} do not add up to {out} rows")
        bn = self.row_block(parts, experts)
        scale_rows = sum(_cdiv(n, bn) for n in parts)
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False))
        scale = nn.Parameter(torch.empty(*lead, scale_rows, _cdiv(fan_in, self.block[1]), dtype=torch.float32),
                             requires_grad=False)
        scale.keep_dtype = True  # the model's cast to the serving dtype leaves it (cast_plain_weights)
        getattr(module, attr).keep_dtype = True
        setattr(module, attr + "_scale_inv", scale)
        setattr(module, attr + "_block", (bn, self.block[1]))
        setattr(module, attr + "_parts", tuple(parts))
        if not experts and not lead:  # a dense product's split-K arrival counters, zero between launches
            from moeserve.kernels.fp8_linear import split_counter_slots

            module.register_buffer(attr + "_split_counters", torch.zeros(split_counter_slots(out), dtype=torch.int32),
                                   persistent=False)

    def load(self, module: nn.Module, attr: str, parts, index: int | None = None) -> None:
        from moeserve.kernels.fp8 import quantize_block_fp8

        weight, scale = getattr(module, attr), getattr(module, attr + "_scale_inv")
        bn = getattr(module, attr + "_block")[0]
        qs, ss = [], []
        for t, s in parts:
            if s is None:  # a plain part: quantized as a checkpoint stores it
                t, s = quantize_block_fp8(t, self.block)
            elif t.dtype != FP8_DTYPE:
                raise ValueError(f"{attr}: a part with a scale_inv must be {FP8_DTYPE}, got {t.dtype}")
            if bn != self.block[0]:  # one scale row per weight row
                s = s.repeat_interleave(self.block[0], dim=-2)[..., :t.shape[-2], :]
            qs.append(t)
            ss.append(s.float())
        w, s = torch.cat(qs, dim=-2), torch.cat(ss, dim=-2)
        if index is None:
            weight.data.copy_(w)
            scale.data.copy_(s)
        else:
            weight.data[index].copy_(w)
            scale.data[index].copy_(s)

    def dequantized(self, module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor:
        weight, scale = getattr(module, attr), getattr(module, attr + "_scale_inv")
        block = getattr(module, attr + "_block")
        if weight.device.type != "cpu":
            return dequantize(weight, scale, block, getattr(module, attr + "_parts"), dtype)
        key = (dtype, cpu_linear.identity(weight, scale))
        if self._dequantized.get(attr, (None,))[0] != key:
            self._dequantized[attr] = (key, dequantize(weight, scale, block, getattr(module, attr + "_parts"), dtype))
        return self._dequantized[attr][1]

    def fuses_lora(self, num_rows: int, backend: str) -> bool:
        """Whether `linear` can take the LoRA expand into its product's epilogue (kernels/fp8_linear.fuses_lora:
        weight-only decode rows on the triton backend)."""
        from moeserve.kernels import fp8_linear

        return backend == "triton" and fp8_linear.fuses_lora(num_rows, self.format.act_quant)

    def input_quant(self, module: nn.Module, x: torch.Tensor, backend: str) -> tuple[int, bool] | None:
        """(group, scale_m_major) in which `linear` reads a batch like x quantized (kernels/fp8_linear.input_quant),
        so the norm that makes x can write that copy (`x_fp8`); None where it reads x as it is."""
        from moeserve.kernels import fp8_linear

        if backend != "triton":
            return None
        return fp8_linear.input_quant(x, module.weight, self.format.act_quant, module.weight_block)

    def linear(self, module: nn.Module, x: torch.Tensor, backend: str, pdl: bool = False, lora=None,
               x_fp8=None) -> torch.Tensor:
        """x @ W^T (+ bias) in x's dtype: kernels/fp8_linear on the "triton" backend (with `lora`, a GemvLoRA
        where fuses_lora, each adapter row's expand in its epilogue); else the dequantized weight (oneDNN-packed on
        the CPU) through the plain product, or the W8A8 twin where activations are quantized."""
        from moeserve.kernels import fp8_linear

        w, s, block = module.weight, module.weight_scale_inv, module.weight_block
        if backend == "triton":
            return fp8_linear.fp8_linear(x, w, s, module.bias, act_quant=self.format.act_quant, block=block,
                                         backend="triton", pdl=pdl, lora=lora, x_fp8=x_fp8,
                                         counters=getattr(module, "weight_split_counters", None))
        if lora is not None or x_fp8 is not None:
            raise ValueError(f"a LoRA expand or a quantized x inside the FP8 product needs the triton backend, not "
                             f"{backend!r}")
        if self.format.act_quant:
            return fp8_linear.fp8_linear_ref(x, w, s, module.bias, act_quant=True, block=block).to(x.dtype)
        plain = self.dequantized(module, "weight", x.dtype)
        return cpu_linear.linear(x, plain, module.packed.get(plain), module.bias)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], parts: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight of stacked parts (each blocked on its own) in `dtype`."""
    from moeserve.kernels.fp8 import dequantize_block_fp8

    out, row, srow = [], 0, 0
    for n in parts:
        nb = _cdiv(n, block[0])
        out.append(dequantize_block_fp8(weight[..., row:row + n, :], scale[..., srow:srow + nb, :], block, dtype))
        row, srow = row + n, srow + nb
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def dequantize_part(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor in `dtype`: cast, or dequantized where it comes with a scale_inv."""
    if scale is None:
        return t.to(dtype)
    from moeserve.kernels.fp8 import WEIGHT_BLOCK, dequantize_block_fp8

    return dequantize_block_fp8(t, scale, WEIGHT_BLOCK, dtype)


def weight_method(fmt: WeightFormat):
    """The hooks of a weight format (PlainWeights, Fp8BlockWeights)."""
    if not fmt.quantized:
        return PlainWeights()
    if fmt.method == "fp8":
        return Fp8BlockWeights(fmt)
    raise ValueError(f"weight format {fmt.method!r} is not implemented (known: fp8)")


def cast_plain_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype) for every floating tensor but the quantized weights and their scales (marked keep_dtype)."""
    return model._apply(lambda t: t if getattr(t, "keep_dtype", False) or not t.is_floating_point() else t.to(dtype))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored (fp8 weights count one byte, their scales four)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
