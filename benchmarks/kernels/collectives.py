"""The collectives tensor and expert parallelism run per layer, at decode message sizes, on this host's GPUs.

    python -m benchmarks.kernels.collectives --world-size 2 --batches 1,8,64,256,512 --hidden 2048 --out bench_out

A TP decode layer all-reduces a [B, H] activation twice (attention and MLP outputs), so at small B the step pays
2 x layers x the all-reduce latency. Per B this times, in the activation dtype:
- `all_reduce`: dist.all_reduce (NCCL on GPUs), eagerly (a host loop) and inside a CUDA graph (as the decode graphs replay it);
- `one_shot` / `two_shot`: torch's symmetric-memory all-reduces (buffers rendezvoused once), eager and in a graph;
- `one_shot_copy` / `two_shot_copy`: the same kernels as the engine calls them (ParallelState.all_reduce under the
  symm_mem backend): from an ordinary tensor into a new one, the one-shot kernel copying the input in itself, the
  two-shot one after a copy. Where they cross decides ONE_SHOT_MAX_BYTES (distributed/parallel_state.py);
- `all_gather` / `reduce_scatter`: the two halves of expert parallelism's all-gather + reduce-scatter dispatch
  ([B, H] gathered from every rank, [world * B, H] reduced and scattered back).
Each op's result is checked once before it is timed (rank r contributes r + 1 everywhere), so an op that computes
the wrong thing reports an error, not a time. Ops the stack lacks (symmetric memory on an older torch, graphs on
CPU) report why they were skipped. On CPU (gloo) the eager rows run: the plumbing test.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moeserve.distributed.parallel_state import SymmMemAllReduce

GRAPH_OPS = 16  # ops captured back to back in one graph (a layer stack's worth), timed per op
SYMM_OPS = ("one_shot", "two_shot", "one_shot_copy", "two_shot_copy")


def _timed(fn, iters: int, device: torch.device) -> float:
    """Mean microseconds per call of an eager host loop."""
    for _ in range(3):
        fn()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


def _all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """Whether every rank got `ok`: the ranks then branch alike (one skipping a collective the others enter
    would hang the run instead of reporting)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _graph_timed(fn, iters: int, device: torch.device) -> float:
    """Mean microseconds per op of GRAPH_OPS ops captured in one CUDA graph and replayed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    error = None
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_OPS):
                fn()
    except Exception as e:  # noqa: BLE001 - every rank learns of it before anyone replays
        error = e
    if not _all_ranks_ok(error is None, device):
        raise RuntimeError(f"capture failed on a rank: {error}" if error else "capture failed on another rank")
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * GRAPH_OPS) * 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ops(B: int, H: int, dtype, device, rank: int, world: int):
    """name -> (fill: sets the inputs to rank + 1, op, check: the op's result is right, error text)."""
    group = dist.group.WORLD
    total = world * (world + 1) / 2
    x = torch.empty(B, H, dtype=dtype, device=device)
    gathered = torch.empty(world * B, H, dtype=dtype, device=device)
    scattered = torch.empty(B, H, dtype=dtype, device=device)
    ops = {
        "all_reduce": (lambda: x.fill_(rank + 1), lambda: dist.all_reduce(x, group=group), lambda: bool((x == total).all())),
        "all_gather": (lambda: x.fill_(rank + 1), lambda: dist.all_gather_into_tensor(gathered, x, group=group),
                       lambda: all(bool((gathered[r * B:(r + 1) * B] == r + 1).all()) for r in range(world))),
        "reduce_scatter": (lambda: gathered.fill_(rank + 1),
                           lambda: dist.reduce_scatter_tensor(scattered, gathered, group=group),
                           lambda: bool((scattered == total).all())),
    }
    if device.type != "cuda":
        return ops, {name: "symmetric memory needs CUDA" for name in SYMM_OPS}
    skipped = {}
    error = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty((B, H), dtype=dtype, device=device)
        symm_mem.rendezvous(buf, name)
        out = torch.empty_like(buf)
        ops["one_shot"] = (lambda: buf.fill_(rank + 1),
                           lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out),
                           lambda: bool((out == total).all()))
        ops["two_shot"] = (lambda: buf.fill_(rank + 1),
                           lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name),
                           lambda: bool((buf == total).all()))
        engine = SymmMemAllReduce.allocate(B * H, dtype, device, group).rendezvous()
        for op_name, reduce in (("one_shot_copy", engine.one_shot), ("two_shot_copy", engine.two_shot)):
            ops[op_name] = _returning_op(reduce, x, rank, total)
    except Exception as e:  # noqa: BLE001 - reported in the table
        error = f"{type(e).__name__}: {e}"[:200]
    if not _all_ranks_ok(error is None, device):  # every rank times the same ops
        for k in SYMM_OPS:
            ops.pop(k, None)
        skipped.update({k: error or "set-up failed on another rank" for k in SYMM_OPS})
    return ops, skipped


def _returning_op(reduce, x: torch.Tensor, rank: int, total: float):
    """(fill, op, check) for an all-reduce that returns its sum in a new tensor."""
    result = {}

    def op():
        result["sum"] = reduce(x)

    return lambda: x.fill_(rank + 1), op, lambda: bool((result["sum"] == total).all())


def run_rank(rank: int, world: int, port: int, args, out_path: str | None) -> None:
    from moeserve.distributed.parallel_state import destroy_parallel_state, init_parallel_state, rendezvous_store

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_parallel_state(rank, world, rendezvous_store(port, world, is_master=False), device, 120.0)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        ops, skipped = _ops(B, args.hidden, dtype, device, rank, world)
        row = {"batch": B, "bytes": B * args.hidden * torch.tensor([], dtype=dtype).element_size(), "ops": {}}
        for name, (fill, op, check) in ops.items():
            fill()
            op()
            _sync(device)
            if not _all_ranks_ok(check(), device):
                row["ops"][name] = {"error": "wrong result on a rank"}
                continue
            entry = {"eager_us": _timed(op, args.iters, device)}
            if device.type == "cuda":
                try:
                    entry["graph_us"] = _graph_timed(op, args.iters, device)
                except Exception as e:  # noqa: BLE001 - reported in the table (every rank raised alike)
                    entry["graph_error"] = f"{type(e).__name__}: {e}"[:200]
            row["ops"][name] = entry
        for name, why in skipped.items():
            row["ops"][name] = {"skipped": why}
        rows.append(row)
    if rank == 0 and out_path is not None:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    destroy_parallel_state()


def _rank_main(rank: int, world: int, port: int, args, out_path: str) -> None:
    run_rank(rank, world, port, args, out_path if rank == 0 else None)


def print_table(rows: list[dict], world: int) -> None:
    names = ["all_reduce", *SYMM_OPS, "all_gather", "reduce_scatter"]
    print(f"\ncollectives over {world} ranks, us per op (eager / in a CUDA graph); [B, H] message")
    print(f"{'B':>5} {'bytes':>9} " + " ".join(f"{n:>17}" for n in names))
    for r in rows:
        cells = []
        for n in names:
            e = r["ops"].get(n, {})
            if "eager_us" in e:
                g = f"{e['graph_us']:.1f}" if "graph_us" in e else "-"
                cells.append(f"{e['eager_us']:.1f} / {g}")
            else:
                cells.append("error" if "error" in e else "skipped")
        print(f"{r['batch']:>5} {r['bytes']:>9} " + " ".join(f"{c:>17}" for c in cells))
    skipped = {n: e["skipped"] for r in rows for n, e in r["ops"].items() if "skipped" in e}
    for n, why in skipped.items():
        print(f"  {n} skipped: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.collectives", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64,256,512")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        ap.error(f"--world-size {args.world_size} needs that many GPUs; this host has {torch.cuda.device_count()}")
    from moeserve.distributed.parallel_state import rendezvous_store

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = rendezvous_store(0, args.world_size + 1, is_master=True)  # the ranks connect to this process's store
    rows_path = str(out / "collectives_rows.json")
    torch.multiprocessing.spawn(_rank_main, args=(args.world_size, store.port, args, rows_path),
                                nprocs=args.world_size, join=True)
    rows = json.loads(Path(rows_path).read_text())
    result = {"world_size": args.world_size, "hidden": args.hidden, "dtype": args.dtype, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}
    (out / "collectives.json").write_text(json.dumps(result, indent=1))
    print_table(rows, args.world_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
