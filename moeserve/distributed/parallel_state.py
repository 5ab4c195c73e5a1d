"""ParallelState: this process's rank, the world size and the process group its layers reduce over.

Created once per process (rank 0 in the engine core, one per worker) and passed to the layers at
construction; no layer reads torch.distributed's global state. The collectives are the ones the
model needs: all-reduce of partial activations (row-parallel outputs, masked embeddings), all-gather
of vocabulary-split logits, and the broadcast of rank 0's sampled tokens. NCCL on CUDA, gloo on CPU:
the same calls either way, so the CPU tests run the code the GPUs run.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on and says which rank."""


@dataclass(frozen=True, eq=False)
class ParallelState:
    rank: int
    world_size: int
    group: "dist.ProcessGroup"
    expert_parallel: bool = False  # routed experts split whole across the ranks (else each expert sliced)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (rank order)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src=src, group=self.group)
        return x


RENDEZVOUS_TIMEOUT_S = 600  # ranks meet after spawning and importing torch: slow machines need long, not dist_timeout


def rendezvous_store(port: int, world_size: int, is_master: bool) -> "dist.TCPStore":
    """Rank 0 serves the store (port 0: the OS picks a free one, read back as store.port); workers connect."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master, timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                         wait_for_workers=False)


def init_parallel_state(rank: int, world_size: int, store: "dist.Store", device: torch.device,
                        timeout_s: float, expert_parallel: bool = False) -> ParallelState:
    """Join the process group (every rank calls this; it returns when all have joined). `timeout_s` bounds
    every later collective. One tensor-parallel engine per process: the group is torch's default group,
    destroyed at shutdown."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process (torch.distributed is "
                           "initialized); shut it down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    return ParallelState(rank, world_size, dist.group.WORLD, expert_parallel)


def destroy_parallel_state() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_parallel_state() -> None:
    """Leave the group without the other ranks (one is gone or hung). NCCL: abort its communicators, which also
    ends kernels waiting on the missing rank; gloo's teardown is local, so it is simply destroyed."""
    from torch.distributed.distributed_c10d import _abort_process_group

    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":  # destroying after an abort could block on the aborted communicators
            _abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is leaving tensor parallelism either way
        pass
