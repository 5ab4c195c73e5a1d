"""Programmatic dependent launch (PDL, Hopper and later): the next kernel of a chain starts while the
current one drains.

A kernel launched with `launch_pdl=True` may begin as soon as every program of the kernel before it has
released its dependents, so its launch and its programs' start overlap the previous kernel's tail. In
exchange it must not touch memory the previous kernel writes or reads before `griddepcontrol.wait`, which
returns once that kernel has finished and flushed its writes. `enter` does both at the top of a kernel:
wait, then release the next one. Every kernel launched with PDL calls it unconditionally in every program,
so the chain stays transitive: a kernel's wait returning means all kernels before it are done.

Measured on the H200 (a CUDA graph of 192 chained norm / GEMV kernels at one row): 5.79 -> 5.23 us per
kernel. Kernels launched without PDL (cuBLAS, torch ops, NCCL) keep the full stream order, before and after.
The arithmetic is untouched, so results are bitwise the same with and without it.

Late wait: since every kernel releases the next only after its own wait, a kernel that starts finds every
kernel two or more back finished; only the one just before may still run. A GEMM or GEMV with a LoRA epilogue
reads that one (the shrink launched just before it) only in its epilogue, and its main loop reads only older
data (activations, routing, weights). Such a kernel waits just before its epilogue and its first store
(`enter_late` / `late`), so the shrink runs under its main loop instead of in front of it.

Early reads: by the same rule a kernel may read, before its wait, what the kernel just before does not write: what
older kernels wrote and what no kernel of the step writes (weights, the rows' adapter slots and their ranks, copied
in before the step). The FP8 expert GEMV reads its pair's slot and rank that way, so after its late wait only the
shrink's partials and B stand before its store. A program must still reach the wait before it returns: one that
left without it would let the next kernel start while this one's predecessor runs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def supported(device: torch.device) -> bool:
    """PDL needs an NVIDIA GPU of compute capability 9.0 or later (not the CPU interpreter)."""
    if _INTERPRET or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """First statement of a kernel that may be launched with PDL: wait for the kernel before, then let the
    next one launch. Compiles to nothing when USE_PDL is off."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def enter_late(USE_PDL: tl.constexpr, LATE: tl.constexpr):
    """`enter` at the top of a kernel (LATE off), or where it is called again with LATE on (before the first
    store and the first read of what the kernel just before wrote). A late kernel runs its main loop while its
    predecessor runs: allowed for what was written two or more kernels back, since every kernel releases the
    next only after its own wait. Every program must reach the LATE call, early returns included."""
    if not LATE:
        enter(USE_PDL)


@triton.jit
def late(USE_PDL: tl.constexpr, LATE: tl.constexpr):
    """The deferred `enter` of a kernel that called `enter_late` with LATE on."""
    if LATE:
        enter(USE_PDL)
