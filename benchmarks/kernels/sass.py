"""A kernel's Hopper machine code without a GPU: compile one Triton kernel for sm_90 on this machine and print its
registers, spills, shared memory, instruction mix and the width of its global loads and stores.

    pip install --target /tmp/triton36 triton==3.6.0      # the GPU machine's Triton, for the same code
    PYTHONPATH=/tmp/triton36:. python -m benchmarks.kernels.sass fp8_moe [--tile 64,128,128,4,3] [--tma] [--lora]
    PYTHONPATH=/tmp/triton36:. python -m benchmarks.kernels.sass dense_shrink | dense_expand | moe_lora_shrink
    PYTHONPATH=/tmp/triton36:. python -m benchmarks.kernels.sass fp8_linear [--tile 16,32,128,4,4] [--lora] | fp8_gemv
    ... --sass FILE   (the whole disassembly, for reading the main loop)

Scalar loads (`LDG.E.U16` where a 16-byte `LDG.E.128` or `LDGSTS...128` was meant), a layout conversion inside a K
loop (`STS`, `BAR.SYNC`, `LDS`), a `WARPGROUP.DEPBAR` right after each `QGMMA`, spills (`STL`): each was found this
way before any device time was spent (BENCHMARKS.md, session 18). Arguments are specialized as the launcher
specializes them on the GPU: every pointer and integer divisible by 16, unit strides the constant 1, except the
parameters a kernel declares `do_not_specialize` and the ones a preset names. Registers decide CTAs per SM
(65,536 registers per SM); the counts are static, so a loop's instructions count once.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's default: a * b + c compiles to one FFMA

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sm90(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, unspecialized=()):
    """fn compiled for sm_90. types: parameter -> Triton type (default i32); constexprs left out take the kernel's
    defaults; `unspecialized`: parameters not marked divisible by 16 (besides the kernel's do_not_specialize)."""
    constexprs = dict(constexprs)
    for p in fn.params:
        if p.is_constexpr and p.name not in constexprs:
            constexprs[p.name] = p.default
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if signature[p.name] != "constexpr" and p.name not in unspecialized and not p.do_not_specialize}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_BIN / name), *args, f.name], capture_output=True, text=True, check=True).stdout


def report(compiled, label: str) -> str:
    """Prints one kernel's summary; returns its disassembly."""
    sass = _tool("nvdisasm", "-c", cubin=compiled.asm["cubin"])
    usage = _tool("cuobjdump", "--dump-resource-usage", cubin=compiled.asm["cubin"])
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops = collections.Counter(m.group(1).split(".")[0]
                              for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    memory = collections.Counter(re.findall(r"\b((?:LDG|STG|LDGSTS)\.E[.A-Z0-9]*)", sass))
    print(f"{label}: registers {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'} B, "
          f"shared {compiled.metadata.shared} B")
    print("  instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    print("  global memory: " + ", ".join(f"{k} {v}" for k, v in sorted(memory.items())))
    return sass


def _fp8_moe(args):
    from moeserve.kernels.fused_moe_fp8 import _moe_fp8_gemm_kernel

    bm, bn, bk, warps, stages = (int(v) for v in args.tile.split(","))
    types = dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", out_ptr="*bf16",
                 topk_weights_ptr="*fp32", sorted_ids_ptr="*i32", block_groups_ptr="*i32", slots_ptr="*i32",
                 ranks_ptr="*i32", lora_b_ptr="*bf16", shrunk_ptr="*fp32", separate_ptr="*i32",
                 w_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>" if args.tma else "*fp8e4nv")
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, SCALE_N=128, SCALE_K=128, ACT_FP8=True,
                      FUSED_ACT=False, ROUTE_WEIGHT=False, GROUP_M=1, USE_PDL=True, HAS_LORA=args.lora,
                      B_SCALAR=128 % bn == 0, W_TMA=args.tma)
    return compile_sm90(_moe_fp8_gemm_kernel, types, constexprs, warps, stages,
                        unspecialized=("w_desc", "top_k", "stride_sh"))


def _dense_shrink(args):
    from moeserve.kernels.lora_dense import _dense_lora_shrink_kernel

    types = dict(x_ptr="*bf16", a_ptr="*bf16", sorted_ids_ptr="*i32", block_slots_ptr="*i32", ranks_ptr="*i32",
                 scratch_ptr="*fp32")
    constexprs = dict(BLOCK_T=16, BLOCK_K=256, BLOCK_R=16, COMPUTE=tl.bfloat16, DOT_PRECISION="tf32",
                      USE_PDL=True, EVEN_K=True, EVEN_R=True)
    return compile_sm90(_dense_lora_shrink_kernel, types, constexprs, 4, 3)


def _dense_expand(args):
    from moeserve.kernels.lora_dense import _dense_lora_expand_kernel

    types = dict(scratch_ptr="*fp32", b_ptr="*bf16", sorted_ids_ptr="*i32", block_slots_ptr="*i32",
                 ranks_ptr="*i32", out_ptr="*bf16")
    constexprs = dict(SIZE0=4096, SIZE1=512, SIZE2=512, SIZE3=0, TILE1=32, TILE2=36, TILE3=40, BLOCK_T=16,
                      BLOCK_N=128, BLOCK_R=16, COMPUTE=tl.bfloat16, DOT_PRECISION="tf32", USE_PDL=True,
                      EVEN_N=True, EVEN_R=True, stride_br=1, stride_on=1)  # unit strides: the launcher's constants
    return compile_sm90(_dense_lora_expand_kernel, types, constexprs, 4, 3)


def _moe_lora_shrink(args):
    from moeserve.kernels.moe_lora import _lora_block_shrink_kernel

    types = dict(src_ptr="*bf16", a_ptr="*bf16", scratch_ptr="*fp32", slots_ptr="*i32", ranks_ptr="*i32",
                 sorted_ids_ptr="*i32", block_groups_ptr="*i32", up_a_ptr="*bf16", separate_ptr="*i32")
    constexprs = dict(FROM_GATE_UP=False, BLOCK_M=16, BLOCK_K=128, RANK_STEP=16, LANES=4, UP_HALF=False,
                      USE_PDL=True)
    return compile_sm90(_lora_block_shrink_kernel, types, constexprs, 4, 3, unspecialized=("top_k", "stride_sh"))


_LORA_EPILOGUE_TYPES = dict(scratch_ptr="*fp32", b_ptr="*bf16", slots_ptr="*i32", ranks_ptr="*i32")


def _fp8_linear(args):
    from moeserve.kernels.fp8_linear import _fp8_linear_kernel

    bm, bn, bk, warps, stages = (int(v) for v in args.tile.split(","))
    types = dict(a_ptr="*bf16", a_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*fp32",
                 out_ptr="*bf16", **_LORA_EPILOGUE_TYPES, partial_ptr="*fp32", counters_ptr="*i32")
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, SCALE_N=128, SCALE_K=128, ACT_FP8=False,
                      HAS_BIAS=False, USE_PDL=True, HAS_LORA=args.lora, LORA_K_SPLITS=1, LORA_ROWS=1,
                      SPLIT_K=args.split_k)
    return compile_sm90(_fp8_linear_kernel, types, constexprs, warps, stages, unspecialized=("R_MAX",))


def _fp8_gemv(args):
    from moeserve.kernels.fp8_linear import _fp8_gemv_kernel

    types = dict(a_ptr="*bf16", a_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*fp32",
                 out_ptr="*bf16", **_LORA_EPILOGUE_TYPES)
    constexprs = dict(BLOCK_T=1, BLOCK_N=4, GROUPS=8, SUB_K=128, EVEN_K=True, SCALE_N=128, SCALE_K=128,
                      ACT_FP8=False, HAS_BIAS=False, USE_PDL=True, HAS_LORA=args.lora, LORA_K_SPLITS=1)
    return compile_sm90(_fp8_gemv_kernel, types, constexprs, 4, 2, unspecialized=("R_MAX",))


PRESETS = {"fp8_moe": _fp8_moe, "dense_shrink": _dense_shrink, "dense_expand": _dense_expand,
           "moe_lora_shrink": _moe_lora_shrink, "fp8_linear": _fp8_linear, "fp8_gemv": _fp8_gemv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.sass", description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(PRESETS))
    ap.add_argument("--tile", default="64,128,128,4,3", help="fp8_moe, fp8_linear: block_m,block_n,block_k,warps,stages")
    ap.add_argument("--split-k", type=int, default=1, help="fp8_linear: programs sharing a tile's K walk")
    ap.add_argument("--tma", action="store_true", help="fp8_moe: weight tiles through a TMA descriptor")
    ap.add_argument("--lora", action="store_true", help="fp8_moe, fp8_linear, fp8_gemv: with the LoRA epilogue")
    ap.add_argument("--sass", help="write the whole disassembly here")
    args = ap.parse_args(argv)
    sass = report(PRESETS[args.kernel](args), f"{args.kernel} (Triton {triton.__version__}, sm_90)")
    if args.sass:
        Path(args.sass).write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
