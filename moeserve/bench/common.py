"""Timing helpers shared by the benchmarks: CUDA-graph timing and the bandwidth ceilings."""
from __future__ import annotations

import statistics

import torch


def graph_time_us(fns, reps: int = 15) -> float:
    """Median µs per call of one CUDA graph that runs every fn in `fns` once (launch gaps removed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()  # compile and allocate outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    del graph
    return statistics.median(times)


def bandwidths(nbytes: int = 4 << 30) -> tuple[float, float]:
    """Bytes/s of a device copy (read + write counted) and of a read-only sum, over `nbytes` of fp32."""
    bufs = [torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()]
    bufs.append(torch.empty_like(bufs[0]))
    copy_us = graph_time_us([lambda: bufs[1].copy_(bufs[0])] * 3, reps=7)
    read_us = graph_time_us([lambda: torch.sum(bufs[0])] * 3, reps=7)
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / (copy_us * 1e-6), nbytes / (read_us * 1e-6)
