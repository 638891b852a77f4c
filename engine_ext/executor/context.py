"""What every part of plan execution reads, and nothing else: the model's shape, the tensor-parallel ranks, the store,
the K/V reader, the counts and the outcome log. One per worker process (``PlanExecutor.context``); the exact and
approximate paths take it instead of the executor, so they depend downward only.

Tensor parallelism (``--tp-size N``): each rank's KV pool holds some of the model's KV heads (SGLang's rule:
store.heads.rank_heads), and all ranks run every forward in lockstep, exchanging activations in the layers' own
collectives. A store entry holds every KV head whatever the layout it was written at, so an entry written at TP=1
serves TP=2 and the other way round:

- reads: each rank reads only its heads (``heads`` in the store's sparse reads);
- writes: after a miss the ranks gather their heads, and the first rank alone stores the entry, once complete;
- decisions: whatever a rank could decide alone (a store read that failed, a damaged K/V block, an approximate
  plan's scores, which sum over each rank's own attention heads) is agreed by all ranks before it changes what
  they compute, so that every rank computes the same rows at the same layers (``agree``, ``total``);
- reports: outcomes, counts and logs come from the first rank only.

At TP=1 every exchange is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.executor.entries import KVFetch
from engine_ext.executor.events import ExecutionEvents, OutcomeLog
from plan.outcome import CAUSES
from store import KVStore
from store.heads import rank_heads


@dataclass(frozen=True)
class ModelShape:
    model_id: str  # what entries are tagged with (engine_ext.executor.model.model_id_of)
    layers: int
    kv_heads: int  # the model's KV heads: what an entry holds
    head_dim: int
    frequencies: torch.Tensor  # the rotary inverse frequencies (moving keys to new positions)


class TensorParallel:
    """This worker process's rank among the model's tensor-parallel ranks, and the exchanges that keep the ranks'
    decisions the same (see the module docstring). ``group``: SGLang's TP GroupCoordinator, None at TP=1."""

    def __init__(self, rank: int = 0, size: int = 1, kv_heads: int = 1, group: Any = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.heads = rank_heads(kv_heads, size, rank)  # the KV heads this rank's pool holds: [start, stop)
        self._replicas = max(1, size // kv_heads)  # ranks holding each head when there are fewer heads than ranks

    @classmethod
    def of_worker(cls, kv_heads: int) -> TensorParallel:
        """This SGLang worker process's rank (TP=1 where SGLang's parallel state is not set up)."""
        from sglang.srt.distributed.parallel_state import get_tp_group

        try:
            group = get_tp_group()
        except (AssertionError, AttributeError):  # no parallel state: a model built outside a worker
            return cls(kv_heads=kv_heads)
        if group.world_size == 1:
            return cls(kv_heads=kv_heads)
        return cls(group.rank_in_group, group.world_size, kv_heads, group)

    @property
    def leader(self) -> bool:
        """The rank that stores entries and reports outcomes, counts and logs."""
        return self.rank == 0

    @property
    def read_heads(self) -> tuple[int, int] | None:
        """The head range this rank reads from the store; None (all) at TP=1."""
        return None if self.size == 1 else self.heads

    def agree(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` holds."""
        if self.group is None:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.group.cpu_group)
        return bool(flag.item())

    def agree_cause(self, cause: str | None) -> str | None:
        """The cause of a full prefill some rank found (the same on every rank), or None if none did."""
        if self.group is None:
            return cause
        names = sorted(CAUSES)
        code = torch.tensor([0 if cause is None else names.index(cause) + 1], dtype=torch.int32)
        torch.distributed.all_reduce(code, op=torch.distributed.ReduceOp.MAX, group=self.group.cpu_group)
        return None if int(code.item()) == 0 else names[int(code.item()) - 1]

    def total(self, score: torch.Tensor) -> torch.Tensor:
        """A score summed over every rank's attention heads (each rank measured its own)."""
        if self.group is None:
            return score
        summed = score.detach().to("cpu", torch.float64).clone()
        torch.distributed.all_reduce(summed, group=self.group.cpu_group)
        return summed.to(score.device)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, summed over the ranks (SGLang's layers leave this to their
        boundaries, which the executor's layer loop replaces)."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def gather_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """(layers, tokens, this rank's heads, head_dim) -> every head of the model, in order (replicated heads
        once). Every rank calls it, at the same point of the same forward."""
        if self.group is None:
            return kv
        gathered = self.group.all_gather(kv.contiguous(), dim=2)  # rank order: heads in order, replicas adjacent
        return gathered[:, :, :: self._replicas].contiguous()


class LazyStore:
    """The store, opened on first use (a worker that never executes a plan never opens it)."""

    def __init__(self, factory: Callable[[], KVStore]) -> None:
        self._factory = factory
        self._store: KVStore | None = None
        self._lock = threading.Lock()

    def get(self) -> KVStore:
        with self._lock:
            if self._store is None:
                self._store = self._factory()
            return self._store


@dataclass(frozen=True)
class Context:
    shape: ModelShape
    tp: TensorParallel
    stores: LazyStore
    reader: KVFetch
    events: ExecutionEvents
    ran: OutcomeLog

    @property
    def store(self) -> KVStore:
        return self.stores.get()
