"""Expert parallelism: the routed experts of every MoE layer sharded over N
ranks (one process each) of a ``torch.distributed`` group, gloo on CPU and
NCCL on CUDA.

Everything else (embeddings, attention, dense MLPs, the router, norms, MTP
layers) is replicated, and every rank runs the whole batch through it. At a
MoE layer each rank takes a contiguous 1/N of the batch's tokens, sends each
(token, expert) slot to the rank that owns the expert (all-to-all), runs the
slots it received through its own experts, returns the results (all-to-all),
sums each of its tokens' top-k outputs, and an all-gather gives every rank the
whole batch again.

The arithmetic is arranged to be the one-rank path's: the router runs on the
whole batch (the same routing bits), an expert sees its tokens in the same
(ascending) order, and each token's expert outputs are weighed and summed in
the same (ascending expert) order, so N ranks reproduce one rank's logits.

The groups are built straight on a ``TCPStore`` (``ProcessGroupGloo`` /
``ProcessGroupNCCL``), not through ``init_process_group``: a process keeps its
default group, if it has one, for whatever else it uses torch.distributed for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

__all__ = [
    "AllToAllStats",
    "ExpertParallel",
    "ExpertParallelError",
    "expert_parallel_from_store",
    "init_expert_parallel",
    "owned_experts",
    "sharded_moe",
    "token_range",
]

# Expert traffic waits on the slowest rank's step; step messages (below) wait
# on an idle server, which may stay idle for days.
DATA_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=365)
STORE_TIMEOUT = timedelta(minutes=5)  # every rank must have joined by then


class ExpertParallelError(RuntimeError):
    """A collective of the expert-parallel group failed: a rank died or the
    ranks disagree. No request explains it; the group is unusable."""


@dataclass
class AllToAllStats:
    """Traffic of the expert-parallel MoE layers, summed over every rank (each
    rank knows the whole routing table, so each one counts the same totals).

    ``all_to_all_bytes`` is what crosses between ranks in dispatch + combine,
    the figure ``llm_core.plan.all_to_all_bytes_per_token`` predicts; the
    all-gather that restores the full batch (attention here is replicated, not
    data-parallel as the plan assumes) and the per-expert counts are apart.
    """

    layer_calls: int = 0  # MoE layer forwards
    token_rows: int = 0  # tokens through MoE layers, summed over layer calls
    remote_slots: int = 0  # (token, expert) pairs sent to another rank
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    gather_bytes: int = 0
    count_bytes: int = 0

    @property
    def all_to_all_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes

    def reset(self) -> None:
        for name, value in AllToAllStats().__dict__.items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, int]:
        return {**self.__dict__, "all_to_all_bytes": self.all_to_all_bytes}


class _Work(Protocol):
    def wait(self) -> Any: ...


@dataclass(frozen=True)
class ExpertParallel:
    """One rank's place in an expert-parallel group."""

    rank: int
    size: int
    group: Any  # torch.distributed ProcessGroup for the expert traffic (NCCL on CUDA, gloo on CPU)
    control: Any  # a gloo ProcessGroup for step messages (host bytes, whatever the device)
    device: torch.device = torch.device("cpu")
    store: Any = None  # the TCPStore: rank 0 serves it, and it must live as long as the group
    stats: AllToAllStats = field(default_factory=AllToAllStats, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} is not in a group of {self.size}")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds."""
        return owned_experts(num_experts, self.size, self.rank)


def owned_experts(num_experts: int, size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous block of the ``num_experts`` routed experts."""
    if num_experts % size:
        raise ValueError(f"{num_experts} routed experts cannot be split evenly over {size} expert-parallel ranks")
    block = num_experts // size
    return range(rank * block, (rank + 1) * block)


def token_range(num_tokens: int, size: int, rank: int) -> range:
    """The tokens of a batch rank ``rank`` routes: contiguous, the first
    ``num_tokens % size`` ranks one more (a decode batch smaller than the
    group leaves some ranks none)."""
    base, extra = divmod(num_tokens, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


# ----------------------------------------------------------------- groups
def init_expert_parallel(size: int, rank: int, init_method: str, backend: str | None = None,
                         device: str | torch.device = "cpu") -> ExpertParallel:
    """Join (rank 0: serve) the group at ``init_method`` (``tcp://HOST:PORT``).
    ``backend``: "gloo" or "nccl" (default: NCCL on CUDA, gloo otherwise)."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
    store = dist.TCPStore(url.hostname, url.port, size, rank == 0, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return expert_parallel_from_store(store, size, rank, backend, device)


def expert_parallel_from_store(store: Any, size: int, rank: int, backend: str | None = None,
                               device: str | torch.device = "cpu") -> ExpertParallel:
    """The group's process groups over an existing store (returns once every rank joined)."""
    device = torch.device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"expert-parallel backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("the NCCL backend needs a CUDA device")
    with _stdout_to_stderr():
        control = dist.ProcessGroupGloo(dist.PrefixStore("swallow-ep/control", store), rank, size, CONTROL_TIMEOUT)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(dist.PrefixStore("swallow-ep/data", store), rank, size, DATA_TIMEOUT)
        else:
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = DATA_TIMEOUT
            group = dist.ProcessGroupNCCL(dist.PrefixStore("swallow-ep/data", store), rank, size, options)
    return ExpertParallel(rank, size, group, control, device, store)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Gloo prints a "connected to N peer ranks" line per rank on the
    process's stdout, where a command's JSON goes: send it to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _wait(work: _Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise ExpertParallelError(f"expert-parallel {what} failed (is a rank gone?): {exc}") from exc


def all_gather(group: Any, tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in rank order."""
    out = [torch.empty_like(tensor) for _ in range(size)]
    _wait(group.allgather([out], [tensor.contiguous()]), "all-gather")
    return out


def all_to_all(group: Any, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
    """Rows of ``send`` split by ``send_rows`` (one count per rank) to each
    rank; what each rank sends here, ``recv_rows`` of it, in rank order."""
    recv = send.new_empty((sum(recv_rows), *send.shape[1:]))
    _wait(group.alltoall_base(recv, send.contiguous(), recv_rows, send_rows, dist.AllToAllOptions()), "all-to-all")
    return recv


def broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    options = dist.BroadcastOptions()
    options.rootRank = root
    _wait(group.broadcast([tensor], options), "broadcast")
    return tensor


# -------------------------------------------------------------- the layer
class _Router(Protocol):
    num_experts: int

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class _Experts(Protocol):
    num_experts: int

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor: ...


def sharded_moe(x: torch.Tensor, router: _Router, experts: _Experts, ep: ExpertParallel) -> torch.Tensor:
    """The routed-expert output for the whole batch ``x`` [T, hidden], which
    every rank of ``ep`` passes whole; ``experts`` are this rank's block."""
    # The whole batch's routing, as one rank computes it: a router logit one
    # ulp off could flip a near-tie between two experts.
    weights, expert_ids = router(x)
    tokens = token_range(x.shape[0], ep.size, ep.rank)
    mine = slice(tokens.start, tokens.stop)
    plan = _plan(expert_ids[mine], router.num_experts, experts.num_experts, ep)
    inbox = all_to_all(ep.group, x[mine][plan.token_of], plan.send_rows, plan.recv_rows)
    if inbox.shape[0]:
        # Unweighted (weight 1 is exact): the token's rank weighs and sums, as one rank does.
        outputs = experts(inbox, torch.ones(inbox.shape[0], 1, device=x.device), plan.local_ids[:, None])
    else:
        outputs = inbox
    returned = all_to_all(ep.group, outputs, plan.recv_rows, plan.send_rows)
    slot_weights = weights[mine].reshape(-1)[plan.order, None].to(returned.dtype)
    combined = x.new_zeros(len(tokens), x.shape[1]).index_add_(0, plan.token_of, returned * slot_weights)
    _count(ep.stats, plan.table, x, experts.num_experts)
    return _gather_tokens(ep, combined, x.shape[0])


@dataclass(frozen=True)
class _Exchange:
    """Who sends what to whom in one MoE layer call, from every rank's counts."""

    order: torch.Tensor  # this rank's (token, k) slots sorted by expert
    token_of: torch.Tensor  # each sorted slot's token, among this rank's
    send_rows: list[int]  # slots this rank sends to each rank
    recv_rows: list[int]  # slots each rank sends here
    local_ids: torch.Tensor  # each received slot's expert, among this rank's
    table: torch.Tensor  # [source rank, expert] slot counts, on the host


def _plan(expert_ids: torch.Tensor, num_experts: int, local: int, ep: ExpertParallel) -> _Exchange:
    device = expert_ids.device
    # Slots by expert, each expert's tokens ascending (stable): the order one rank uses.
    flat = expert_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    # Every rank's per-expert counts give the split sizes of both all-to-alls,
    # and which of this rank's experts each received row is for.
    table = torch.stack(all_gather(ep.group, counts, ep.size)).cpu()
    slots = table.view(ep.size, ep.size, local)  # [source, owner, owner's expert]
    received = slots[:, ep.rank]  # [source, my expert]
    # Received rows come by source rank, so by token; sorted (stably) by
    # expert, each expert then sees its tokens in ascending order, as on one rank.
    local_ids = torch.arange(local, device=device).repeat(ep.size).repeat_interleave(received.reshape(-1).to(device))
    return _Exchange(order, order // expert_ids.shape[1], slots[ep.rank].sum(-1).tolist(),
                     received.sum(-1).tolist(), local_ids, table)


def _gather_tokens(ep: ExpertParallel, mine: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The whole batch's rows from every rank's slice (padded to the widest:
    gloo gathers equal shapes)."""
    widest = len(token_range(num_tokens, ep.size, 0))
    padded = mine.new_zeros(widest, mine.shape[1])
    padded[: mine.shape[0]] = mine
    parts = all_gather(ep.group, padded, ep.size)
    return torch.cat([part[: len(token_range(num_tokens, ep.size, r))] for r, part in enumerate(parts)])


def _count(stats: AllToAllStats, table: torch.Tensor, x: torch.Tensor, local: int) -> None:
    size = table.shape[0]
    per_pair = table.view(size, size, local).sum(-1)  # [source, owner]
    remote = int(per_pair.sum() - per_pair.diagonal().sum())
    row_bytes = x.shape[1] * x.element_size()
    stats.layer_calls += 1
    stats.token_rows += x.shape[0]
    stats.remote_slots += remote
    stats.dispatch_bytes += remote * row_bytes
    stats.combine_bytes += remote * row_bytes
    stats.gather_bytes += (size - 1) * x.shape[0] * row_bytes
    stats.count_bytes += size * (size - 1) * table.shape[1] * table.element_size()
