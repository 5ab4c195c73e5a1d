"""The messages rank 0 (worker/parallel_runner.py) sends the other tensor-parallel ranks (worker/tp_worker.py), one
typed record each, and their codec.

Transport: one multiprocessing pipe per worker, each message pickled (the step's batch travels as numpy arrays, an
adapter as its tensors). A worker runs the handler registered for the message's type, in order; a message that is
`answered` gets one WorkerReply (rank 0 waits for it from every worker), the others none (a failing step breaks the
collectives instead, and rank 0 names the rank). A worker's failure travels by type, as the frontend boundary carries
errors (moeserve/messages.py): rank 0 raises it again as the same class.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import ClassVar

from moeserve.messages import error_from_wire, error_to_wire
from moeserve.worker.graph_runner import GraphKey


class WorkerMessageError(ValueError):
    """Bytes on the pipe that are not a message of this boundary."""


@dataclass
class StepPlan:
    """One step as rank 0 decided it; every rank runs exactly this."""
    answered: ClassVar[bool] = False
    batch: dict  # the host ForwardBatch as numpy arrays and plain values (see tp_step.batch_to_wire)
    key: GraphKey | None  # the graph every rank replays; None: eager
    pending: bool  # rows read their input token from the previous step's sampled tokens
    sample_rows: list[int]  # rows whose logits are computed for sampling
    prompt_rows: list[tuple[int, int]]  # (first row, count) of prompt-logprob rows, in order


@dataclass
class AllocateKVCache:
    """Size this rank's KV cache (None: from its free memory); answered with the number of blocks."""
    answered: ClassVar[bool] = True
    num_blocks: int | None


@dataclass
class ResizeKVCache:
    """Every rank uses the smallest count: reallocate if this rank's differs."""
    answered: ClassVar[bool] = True
    num_blocks: int


@dataclass
class CreateLoRAPool:
    answered: ClassVar[bool] = True
    targets: list[str]
    max_loras: int
    max_rank: int
    separate_gate_up: bool


@dataclass
class LoadLoRASlot:
    """Copy this rank's slice of `adapter` (a parsed LoRAAdapter, whole) into `slot`."""
    answered: ClassVar[bool] = True
    slot: int
    adapter: object


@dataclass
class ClearLoRASlot:
    answered: ClassVar[bool] = False
    slot: int


@dataclass
class CaptureGraphs:
    answered: ClassVar[bool] = True


@dataclass
class GetReplayCounts:
    """Answered with the worker's graph replays per GraphKey (tests compare them with rank 0's)."""
    answered: ClassVar[bool] = True


@dataclass
class GetLoRASlots:
    """Answered with the worker's slots as (rank, holds any nonzero weight)."""
    answered: ClassVar[bool] = True


@dataclass
class GetAllReduceBackend:
    answered: ClassVar[bool] = True


@dataclass
class StopWorker:
    """Release the graphs, leave the process group, exit."""
    answered: ClassVar[bool] = False


@dataclass
class WorkerReply:
    """A worker's answer: the value asked for, or what failed as (its class's tag, its message)."""
    value: object = None
    error: tuple[str, str] | None = None

    @classmethod
    def failed(cls, e: BaseException) -> WorkerReply:
        return cls(error=error_to_wire(e))

    def raised_on(self, rank: int, what: str) -> Exception:
        """The worker's failure again, of its own class, its message naming the rank and what it was doing."""
        tag, message = self.error
        return error_from_wire(tag, f"tensor-parallel rank {rank} failed {what}: {message}")


WORKER_MESSAGES = (StepPlan, AllocateKVCache, ResizeKVCache, CreateLoRAPool, LoadLoRASlot, ClearLoRASlot,
                   CaptureGraphs, GetReplayCounts, GetLoRASlots, GetAllReduceBackend, StopWorker, WorkerReply)


def encode(msg) -> bytes:
    if type(msg) not in WORKER_MESSAGES:
        raise TypeError(f"{type(msg).__name__} is not a tensor-parallel message (worker/tp_messages.py)")
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    msg = pickle.loads(data)
    if type(msg) not in WORKER_MESSAGES:
        raise WorkerMessageError(f"{type(msg).__name__} on a tensor-parallel pipe is not a message of this boundary "
                                 "(worker/tp_messages.py)")
    return msg
