"""Test helper: one rank of a gloo group choosing its all-reduce backend, with a CPU stand-in for symmetric memory.

Symmetric memory needs CUDA; on CPU `FakeSymmMem` takes its place so the choice logic runs for real: the start-up
agreement (a step failing on one rank sends every rank to the process group), the routing of each tensor (the
fake's "kernels" count their calls; what does not fit goes through gloo), and the release before the group goes.
Its kernels are gloo sums into a new tensor, so every route gives the true sum.
"""
import json
from pathlib import Path

import torch
import torch.distributed as dist

from moeserve.distributed import parallel_state as ps

BUFFER = 64  # elements of the fake's buffer
ONE_SHOT_MAX = 16  # elements: one-shot up to here, two-shot above


class FakeSymmMem(ps.SymmMemAllReduce):
    fail: tuple[str, int] | None = None  # (step, rank) that raises, or gives a wrong sum for "check"
    instances: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []
        FakeSymmMem.instances.append(self)

    @classmethod
    def allocate(cls, numel, dtype, device, group):
        cls._maybe_fail("allocate", group.rank())
        return cls(torch.empty(numel, dtype=dtype, device=device), group.group_name, group.size(),
                   one_shot_max_bytes=ONE_SHOT_MAX * torch.tensor([], dtype=dtype).element_size())

    def rendezvous(self):
        self._maybe_fail("rendezvous", dist.get_rank())
        return self

    def one_shot(self, x):
        return self._sum("one_shot", x)

    def two_shot(self, x):
        return self._sum("two_shot", x)

    def _sum(self, kind, x):
        self.calls.append((kind, x.numel()))
        out = x.clone()
        dist.all_reduce(out)
        if FakeSymmMem.fail == ("check", dist.get_rank()):
            out += 1
        return out

    @classmethod
    def _maybe_fail(cls, step, rank):
        if cls.fail == (step, rank):
            raise RuntimeError(f"simulated {step} failure")


REAL = (ps.SymmMemAllReduce, ps.symm_mem_unavailable)


def choose_backends(rank: int, world: int, port: int, scenarios: list, out_dir: str) -> None:
    """For each (fake, fail) scenario in turn, in this one process (so the group is left and joined again): join a
    gloo group asking for a symmetric buffer; record the backend chosen, the sums of all-reduces of several
    shapes and which took the symmetric path, and whether leaving freed the buffer and the group. `fake`: the
    CPU stand-in replaces symmetric memory, failing at `fail` = (step, rank); else the real check refuses CPU."""
    client = ps.rendezvous_store(port, world, is_master=False)
    for i, (fake, fail) in enumerate(scenarios):
        ps.SymmMemAllReduce, ps.symm_mem_unavailable = (FakeSymmMem, lambda *args: None) if fake else REAL
        FakeSymmMem.fail = tuple(fail) if fail else None
        ps._symm_mem_rendezvoused = FakeSymmMem.fail == ("earlier-engine", rank)  # the fake never sets it itself
        FakeSymmMem.instances = []
        store = dist.PrefixStore(f"scenario{i}", client)  # keys of an earlier group do not leak into this one
        tp = ps.init_parallel_state(rank, world, store, torch.device("cpu"), 60.0,
                                    symm_mem_buffer=(BUFFER, torch.float32))
        result = {"backend": tp.all_reduce_backend, "sums": {}, "calls": []}
        cases = {
            "small": torch.full((2, 8), rank + 1.0),  # 16 elements: one-shot
            "large": torch.full((4, 16), rank + 1.0),  # 64: the whole buffer, two-shot
            "oversize": torch.full((5, 16), rank + 1.0),  # 80 > 64: gloo
            "fp64": torch.full((2, 8), rank + 1.0, dtype=torch.float64),  # not the buffer's dtype: gloo
            "ragged": torch.full((3,), rank + 1.0),  # not a whole 16-byte vector per rank: gloo
        }
        for name, x in cases.items():
            result["sums"][name] = sorted(set(tp.all_reduce(x).flatten().tolist()))
        if tp.symm_mem is not None:
            result["calls"] = tp.symm_mem.calls
        ps.destroy_parallel_state(tp)
        result["freed"] = [f.buffer is None for f in FakeSymmMem.instances]
        result["group_left"] = not dist.is_initialized()
        Path(out_dir, f"rank{rank}-{i}.json").write_text(json.dumps(result))
