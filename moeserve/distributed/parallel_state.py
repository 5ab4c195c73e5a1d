"""ParallelState: this process's rank, the world size and the process group its layers reduce over.

Created once per process (rank 0 in the engine core, one per worker) and passed to the layers at
construction; no layer reads torch.distributed's global state. The collectives are the ones the
model needs: all-reduce of partial activations (row-parallel outputs, masked embeddings), all-gather
of vocabulary-split logits, and the broadcast of rank 0's sampled tokens. NCCL on CUDA, gloo on CPU:
the same calls either way, so the CPU tests run the code the GPUs run.

On CUDA the activation all-reduces can instead go through a symmetric-memory buffer (torch's one-shot and
two-shot all-reduce kernels read the peers' buffers over NVLink directly): at decode sizes they took 0.44-0.64x
NCCL's time on two H200s (benchmarks.kernels.collectives, kernels alone). The ranks agree on it at start-up;
what does not fit that buffer still goes through NCCL.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("moeserve")

# Activations larger than this are all-reduced by NCCL: its bandwidth-bound algorithms serve big prefill chunks,
# and the buffer stays small. Below ONE_SHOT_MAX_BYTES the one-shot kernel (every rank reads every peer's whole
# buffer, the input copied in by the kernel itself) beats two-shot plus its copy; the lead tunes both with
# `benchmarks.kernels.collectives` (rows one_shot_copy / two_shot_copy are the calls made here).
SYMM_MEM_MAX_BYTES = 16 << 20
ONE_SHOT_MAX_BYTES = 512 << 10
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Whether this process has rendezvoused a symmetric buffer. torch (2.11) keeps per-group symmetric-memory state that
# outlives the process group: a second engine in the same process (the default group's name comes back) hung in
# its rendezvous on two H200s, both ranks waiting. So symmetric memory serves the first tensor-parallel engine of a
# process; a later one all-reduces through NCCL (a server runs one engine per process; tests start several).
_symm_mem_rendezvoused = False


class SymmMemAllReduce:
    """Sums activations over the ranks through one symmetric-memory buffer (torch.distributed._symmetric_memory)
    instead of NCCL. The buffer is allocated and rendezvoused once at start-up, before any graph is captured, and
    never moves (graphs record its address). A call reduces into a new tensor: small messages with the one-shot
    kernel, which copies the input into the buffer itself (one launch); larger ones copy the input in and run the
    two-shot kernel, which writes the sum straight into the result (two launches). Both give every rank the same
    bits: one-shot adds the ranks' parts in rank order on every rank, two-shot reduces each slice once.

    Writing the producers (o_proj, the MoE's combine) straight into the buffer would save the two-shot copy, but
    needs an `out=` through the LoRA and MoE kernels; the one-shot path already has no extra launch."""

    def __init__(self, buffer: torch.Tensor, group_name: str, world_size: int,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES):
        self.buffer = buffer  # 1-D, rendezvoused
        self.handle = None  # the _SymmetricMemory of the buffer, kept alive with it
        self.group_name = group_name
        size = buffer.element_size()
        # two-shot splits the message into one slice per rank, in 16-byte vectors
        self.multiple = world_size * 16 // size
        self.one_shot_max_numel = one_shot_max_bytes // size

    @classmethod
    def allocate(cls, numel: int, dtype: torch.dtype, device: torch.device, group: "dist.ProcessGroup"
                 ) -> "SymmMemAllReduce":
        """This rank's buffer."""
        import torch.distributed._symmetric_memory as symm_mem

        return cls(symm_mem.empty(numel, dtype=dtype, device=device), group.group_name, group.size())

    def rendezvous(self) -> "SymmMemAllReduce":
        """Map every rank's buffer into this one's address space (collective)."""
        import torch.distributed._symmetric_memory as symm_mem

        global _symm_mem_rendezvoused
        _symm_mem_rendezvoused = True  # set before: a rendezvous that fails half-way leaves the state behind too
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        return self

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x can be reduced here: the buffer's device and dtype, contiguous, within the buffer, a whole
        number of 16-byte vectors per rank. Host-side only (no sync), so graphs and eager steps decide alike."""
        b = self.buffer
        return (b is not None and x.device == b.device and x.dtype == b.dtype and x.is_contiguous()
                and 0 < x.numel() <= b.numel() and x.numel() % self.multiple == 0
                and x.storage_offset() * x.element_size() % 16 == 0)  # one-shot refuses misaligned inputs

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.one_shot(x) if x.numel() <= self.one_shot_max_numel else self.two_shot(x)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        staged = self.buffer[:x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        return out

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        staged = self.buffer[:x.numel()].view_as(x)
        staged.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out

    def close(self) -> None:
        """Drop the buffer, back to torch's symmetric-memory pool (after the graphs that recorded it, before the
        process group goes)."""
        if self.buffer is not None and self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        self.buffer = self.handle = None


@dataclass(frozen=True, eq=False)
class ParallelState:
    rank: int
    world_size: int
    group: "dist.ProcessGroup"
    expert_parallel: bool = False  # routed experts split whole across the ranks (else each expert sliced)
    symm_mem: SymmMemAllReduce | None = None  # the all-reduce backend is symmetric memory (where it fits)

    @property
    def all_reduce_backend(self) -> str:
        """"symm_mem", or the process group's own backend ("nccl" / "gloo") for every all-reduce."""
        if self.symm_mem is not None and self.symm_mem.buffer is not None:
            return "symm_mem"
        return dist.get_backend(self.group) if self.group is not None else "none"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks and return the sum: x itself reduced in place (NCCL, gloo) or a new tensor
        (symmetric memory), so callers use the returned tensor."""
        if self.symm_mem is not None and self.symm_mem.fits(x):
            return self.symm_mem.all_reduce(x)
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

    def release_symm_mem(self) -> None:
        """Free the symmetric buffer; later all-reduces (none are expected) would go through the process group."""
        if self.symm_mem is not None:
            self.symm_mem.close()


RENDEZVOUS_TIMEOUT_S = 600  # ranks meet after spawning and importing torch: slow machines need long, not dist_timeout


def rendezvous_store(port: int, world_size: int, is_master: bool) -> "dist.TCPStore":
    """Rank 0 serves the store (port 0: the OS picks a free one, read back as store.port); workers connect."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master, timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                         wait_for_workers=False)


def init_parallel_state(rank: int, world_size: int, store: "dist.Store", device: torch.device,
                        timeout_s: float, expert_parallel: bool = False,
                        symm_mem_buffer: tuple[int, torch.dtype] | None = None) -> ParallelState:
    """Join the process group (every rank calls this; it returns when all have joined). `timeout_s` bounds
    every later collective. One tensor-parallel engine per process: the group is torch's default group,
    destroyed at shutdown. `symm_mem_buffer` (elements, dtype): all-reduce activations through a symmetric
    buffer of that size where every rank can (see open_symm_mem_all_reduce); None: the process group only."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process (torch.distributed is "
                           "initialized); shut it down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    tp = ParallelState(rank, world_size, dist.group.WORLD, expert_parallel)
    if symm_mem_buffer is not None:
        tp = dataclasses.replace(tp, symm_mem=open_symm_mem_all_reduce(tp, device, *symm_mem_buffer))
    return tp


def symm_mem_unavailable(device: torch.device, world_size: int, dtype: torch.dtype) -> str | None:
    """Why symmetric memory cannot serve this engine's all-reduces (the same answer on every rank), or None."""
    if device.type != "cuda":
        return "symmetric memory needs CUDA"
    if world_size < 2:
        return "one rank has nothing to reduce"
    if dtype not in SYMM_MEM_DTYPES:
        return f"no symmetric-memory all-reduce for {dtype}"
    # before 2.11 a rendezvous needs enable_symm_mem_for_group, whose per-name store outlives the process group
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
        return f"the symmetric-memory all-reduce needs torch >= 2.11 (this is {torch.__version__})"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401 - registers the symm_mem ops' Python side
    except ImportError as e:
        return f"this torch has no symmetric memory ({e})"
    missing = [op for op in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out")
               if not hasattr(torch.ops.symm_mem, op)]
    if missing:
        return f"torch {torch.__version__} lacks torch.ops.symm_mem.{', '.join(missing)}"
    return None


def _failed_ranks(ok: bool, tp: ParallelState, device: torch.device) -> list[int]:
    """The ranks on which a local step failed, known to every rank (a collective): all ranks then branch alike
    instead of one waiting in a collective that another skipped."""
    flags = torch.zeros(tp.world_size, dtype=torch.int32, device=device)
    flags[tp.rank] = 0 if ok else 1
    dist.all_reduce(flags, group=tp.group)
    return [r for r, failed in enumerate(flags.tolist()) if failed]


def _check_sums(symm: SymmMemAllReduce, tp: ParallelState) -> SymmMemAllReduce:
    """Both kernels once on a small message (rank r adds r + 1): a platform where the peers' memory cannot be
    read correctly is refused here, not discovered in the model's output."""
    n = min(symm.buffer.numel(), 4096) // symm.multiple * symm.multiple
    if n == 0:
        raise ValueError(f"a buffer of {symm.buffer.numel()} elements holds no {symm.multiple}-element message")
    x = torch.full((n,), tp.rank + 1, dtype=symm.buffer.dtype, device=symm.buffer.device)
    want = tp.world_size * (tp.world_size + 1) / 2
    sums = {"one-shot": symm.one_shot(x), "two-shot": symm.two_shot(x)}  # both run on every rank, checked after
    wrong = [name for name, got in sums.items() if not bool((got == want).all())]
    if wrong:
        raise RuntimeError(f"the {' and '.join(wrong)} all-reduce gave a wrong sum")
    return symm


def _refuse_if_rendezvoused() -> None:
    """A process that rendezvoused a symmetric buffer before (see _symm_mem_rendezvoused) must not again; its own
    agreed step, before the allocation, so no rank is inside a collective allocation while another refuses."""
    if _symm_mem_rendezvoused:
        raise RuntimeError("this process set up symmetric memory for an earlier engine; torch keeps per-group "
                           "state a second rendezvous hangs on")


def open_symm_mem_all_reduce(tp: ParallelState, device: torch.device, numel: int,
                             dtype: torch.dtype) -> SymmMemAllReduce | None:
    """The symmetric-memory all-reduce over tp's group, or None (every all-reduce then goes through the process
    group). Each step that can fail on one rank — this process having set it up before, allocating (collective
    under some symmetric-memory backends), the rendezvous, a first checked reduction — is followed by an agreement: the ranks fall back to NCCL together, and the log names the rank that failed."""
    why = symm_mem_unavailable(device, tp.world_size, dtype)
    if why is not None:
        if tp.rank == 0:
            logger.info("all-reduce through the process group: %s", why)
        return None
    symm = None
    steps = (("the first engine of this process", lambda _: _refuse_if_rendezvoused()),
             ("allocating its buffer", lambda _: SymmMemAllReduce.allocate(numel, dtype, device, tp.group)),
             ("the rendezvous", lambda s: s.rendezvous()),
             ("checking its sums", lambda s: _check_sums(s, tp)))
    for what, step in steps:
        error = None
        try:
            symm = step(symm)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, then all fall back together
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            logger.warning("tensor-parallel rank %d: symmetric memory failed %s (%s)", tp.rank, what, error)
        failed = _failed_ranks(error is None, tp, device)
        if failed:
            if symm is not None:
                symm.close()
            if tp.rank == 0:
                logger.warning("symmetric-memory all-reduce unavailable: %s failed on rank(s) %s; all-reduces go "
                               "through %s", what, failed, dist.get_backend(tp.group))
            return None
    if tp.rank == 0:
        logger.info("all-reduce through symmetric memory: %.1f MiB buffer per rank, one-shot up to %d KiB, two-shot "
                    "above, NCCL for what does not fit", symm.buffer.numel() * symm.buffer.element_size() / 2**20,
                    symm.one_shot_max_numel * symm.buffer.element_size() // 1024)
    return symm


def destroy_parallel_state(tp: ParallelState | None = None) -> None:
    """Leave tensor parallelism, in order: the symmetric buffer (the graphs that recorded it are gone already),
    then the process group."""
    if tp is not None:
        tp.release_symm_mem()
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_parallel_state() -> None:
    """Leave the group without the other ranks (one is gone or hung). NCCL: abort its communicators, which also
    ends NCCL kernels waiting on the missing rank; gloo's teardown is local, so it is simply destroyed. A
    symmetric-memory all-reduce kernel waiting on the missing rank has no timeout and no abort: after such a
    failure the device may stay busy, and the process should exit rather than start another engine."""
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
