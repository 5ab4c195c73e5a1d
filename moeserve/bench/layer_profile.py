"""Per-layer kernel budget of a decode step (`bench decode --profile`).

A decoder layer is cut into the regions its forward runs one after another (residual add + input norm,
qkv GEMM, q/k norm + rotary + KV write, attention, o_proj, residual add + post-attention norm, router,
experts). Under tensor / expert parallelism the two all-reduces of the layer (after o_proj and after the MoE)
are regions of their own, named by the path they take (symmetric memory one-shot / two-shot, or the process
group's backend); every rank must then run the regions in lockstep (bench/tp_profile.py). The layer is the
residual-stream form: the add after the MLP is the next layer's input norm's, so the layer profiled is a
middle one (its input norm adds the previous MLP output to the residual). Each region is timed as one
CUDA graph that runs it for every layer of the model in turn, so no layer's weights are still in L2 when
it runs again (a region replayed on one layer alone would read from L2 and look faster than it is). Its
floor is the bytes it must move at the read bandwidth measured in the same run; the kernel count comes
from the profiler over one replay.

`layer_regions` rebuilds the layer forward from the same modules the model uses; a CPU test chains the
regions and checks that they reproduce `DecoderLayer.forward`, so the budget cannot drift from the layer. The
order is spelled here, not read off the layer: the regions cut through three forwards (the layer's, Attention's
qkv / prologue / attend / o_proj, the MoE block's route / experts) and each carries the bytes it must move, which
no forward knows; turning those forwards into lists of named steps for the profiler alone would make the code
every step runs (eager, compiled and in CUDA graphs) harder to read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moeserve.layers.batch import ForwardBatch
from moeserve.models.moe_decoder import DecoderLayer


@dataclass
class Region:
    name: str
    run: Callable[[], torch.Tensor]  # runs the region on static inputs, returns its output
    nbytes: int  # bytes it must read + write at this batch size


def _elem(t: torch.Tensor) -> int:
    return t.element_size()


def layer_regions(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch, k_cache,
                  v_cache, ctx_len: int) -> tuple[list[Region], tuple[torch.Tensor, torch.Tensor]]:
    """The regions of `layer` at input (x, residual) [T, H] (a decode batch), each bound to the inputs the
    previous region produced, and the layer's output (MLP output, residual) computed by chaining them (for the
    equivalence test)."""
    attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
    T, H = x.shape
    b = _elem(x)
    q_size, kv_size, d = spec.q_size, spec.kv_size, attn.d
    regions: list[Region] = []
    state: dict = {}  # each region reads what the one before it produced

    def add(name: str, fn, nbytes: int, key: str):
        state[key] = fn()
        regions.append(Region(name, fn, int(nbytes)))

    def add_all_reduce(where: str, key: str):
        """The layer's all-reduce of state[key] (a per-rank partial sum), on a scratch copy: NCCL and gloo reduce
        in place, so every timed call sums the scratch again, while the chain goes on from a copy of the first sum.
        Its bytes are the activation read and the sum written; the link to the peers, not HBM, bounds it, so its
        share of that floor is low by nature."""
        if layer.tp is None:
            return
        scratch = state[key].clone()
        fn = lambda: layer.tp.all_reduce(scratch)  # noqa: E731
        add(f"{where} all_reduce {all_reduce_path(layer.tp, scratch)}", fn, 2 * scratch.numel() * b, key)
        state[key] = state[key].clone()  # later timed calls keep summing the scratch; the chain keeps the sum

    add("add+input_norm", lambda: layer.input_layernorm(x, residual), 4 * T * H * b + H * b, "h_res")
    qkv_w = attn.qkv_proj.weight
    add("qkv_proj", lambda: attn.qkv_proj(state["h_res"][0], batch.lora),
        qkv_w.numel() * _elem(qkv_w) + T * (H + q_size + 2 * kv_size) * b, "qkv")
    # reads qkv and a cos/sin row per token, writes q and this step's K/V into the cache (in the cache's dtype)
    add("qk_norm+rotary+kv_write",
        lambda: attn.qk_norm_rotary_write_kv(state["qkv"], batch.positions, batch.attn, k_cache, v_cache),
        T * (2 * q_size + 2 * kv_size) * b + 2 * T * kv_size * _elem(k_cache) + 2 * T * d * _elem(attn.rotary.cos),
        "q")
    add("attention", lambda: attn.attend(state["q"], batch.attn, k_cache, v_cache),
        T * ctx_len * 2 * kv_size * _elem(k_cache) + 2 * T * q_size * b, "o")
    o_w = attn.o_proj.weight
    add("o_proj", lambda: attn.o_proj(state["o"], batch.lora), o_w.numel() * _elem(o_w) + T * (q_size + H) * b,
        "attn_out")
    add_all_reduce("attn", "attn_out")
    add("add+post_norm", lambda: layer.post_attention_layernorm(state["attn_out"], state["h_res"][1]),
        4 * T * H * b + H * b, "x2h")
    if not layer.is_sparse:
        mlp_bytes = sum(p.numel() * _elem(p) for p in mlp.parameters())
        add("dense_mlp", lambda: mlp(state["x2h"][0], batch.lora), mlp_bytes + 2 * T * H * b, "y")
    else:
        # routed over all E experts (the router is whole on every rank); this rank holds w13.shape[0] of them
        # (E / N under expert parallelism), each sliced to its share of the intermediate size under tensor parallelism
        E, k_top, local = mlp.spec.num_experts, mlp.spec.top_k, mlp.w13.shape[0]
        add("router", lambda: mlp.route(state["x2h"][0], batch.lora),
            mlp.router.weight.numel() * _elem(mlp.router.weight) + T * H * b, "routing")
        touched = local * (1 - (1 - k_top / E) ** T)  # local experts a batch of T tokens is expected to touch
        per_expert = (mlp.w13[0].numel() + mlp.w2[0].numel()) * _elem(mlp.w13)

        def experts():
            w, ids = state["routing"]
            return mlp.experts(state["x2h"][0], w, ids, batch.lora)

        shared_bytes = 0 if mlp.shared_expert is None else sum(
            p.numel() * _elem(p) for p in mlp.shared_expert.parameters())
        add("experts", experts, touched * per_expert + shared_bytes + 2 * T * H * b, "y")
    add_all_reduce("mlp", "y")
    return regions, (state["y"], state["x2h"][1])


def all_reduce_path(tp, x: torch.Tensor) -> str:
    """How tp.all_reduce sums x (parallel_state.ParallelState.all_reduce): "symm_mem one-shot" / "symm_mem
    two-shot" where x fits the symmetric buffer, else the process group's backend."""
    symm = tp.symm_mem
    if symm is not None and symm.fits(x):
        return "symm_mem " + ("one-shot" if x.numel() <= symm.one_shot_max_numel else "two-shot")
    import torch.distributed as dist

    return dist.get_backend(tp.group)


def kernel_names(fn: Callable[[], object]) -> list[str] | None:
    """Names of the device kernels one call of `fn` launches, in order (torch profiler); None where the
    profiler cannot tell."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset"))]
        return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]
    except Exception:  # a profiler that is not built for this device: the table still has times
        return None


def layer_budget(model, kv_caches, batch: ForwardBatch, x: torch.Tensor, ctx_len: int, bandwidth: float,
                 timer: Callable[[list], float]) -> list[dict]:
    """One row per region: µs per layer (timed over every routed-expert layer in turn), bytes, floor µs,
    share of the floor, kernels per layer; and a last row for the whole layer. `kv_caches`: the model runner's
    (k, v) pair of every layer."""
    # the routed-expert layers (dense layers, where a family has them, cut into other regions)
    pairs = [(layer, kv) for layer, kv in zip(model.layers, kv_caches) if layer.is_sparse] or \
        list(zip(model.layers, kv_caches))
    residual = x.flip(0).contiguous()  # a residual stream unlike x (a middle layer's input norm adds them)
    batch = model.group_lora_rows(batch)  # once, as the model's forward does for all its layers
    per_layer = [layer_regions(layer, x, residual, batch, k, v, ctx_len)[0] for layer, (k, v) in pairs]
    # every timing first: the profiler (kernel names) can leave tracing hooks that slow later launches
    times = [timer([regions[i].run for regions in per_layer]) for i in range(len(per_layer[0]))]
    layer_fns = [lambda layer=layer, k=k, v=v: layer(x, residual, batch, k, v) for layer, (k, v) in pairs]
    layer_us = timer(layer_fns)
    rows = []
    for region, us in zip(per_layer[0], times):
        names = kernel_names(region.run) if x.is_cuda else None
        floor_us = region.nbytes / bandwidth * 1e6
        rows.append({"region": region.name, "us": us, "bytes": region.nbytes, "floor_us": floor_us,
                     "share_of_floor": floor_us / us if us > 0 else None,
                     "kernels": None if names is None else len(names), "kernel_names": names})
    nbytes = sum(r["bytes"] for r in rows)
    floor_us = nbytes / bandwidth * 1e6
    names = kernel_names(layer_fns[0]) if x.is_cuda else None
    rows.append({"region": f"layer (of {len(pairs)})", "us": layer_us, "bytes": nbytes, "floor_us": floor_us,
                 "share_of_floor": floor_us / layer_us if layer_us > 0 else None,
                 "kernels": None if names is None else len(names), "kernel_names": names})
    return rows


def print_budget(B: int, rows: list[dict], where: str = "") -> None:
    print(f"\nkernel budget of one layer{where}, decode B={B} (regions timed across all layers in one CUDA graph)")
    print(f"{'region':>32} {'us':>8} {'bytes':>12} {'floor us':>9} {'share':>6} {'kernels':>7}")
    for r in rows:
        share = f"{r['share_of_floor']:.0%}" if r["share_of_floor"] is not None else "-"
        kern = r["kernels"] if r["kernels"] is not None else "-"
        print(f"{r['region']:>32} {r['us']:8.1f} {r['bytes']:12,d} {r['floor_us']:9.1f} {share:>6} {kern!s:>7}")
