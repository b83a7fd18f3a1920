"""Collectives for distributed K-FAC over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Three kinds of traffic (TPDS §4.3; KAISA §3.1):
    * batch factors reduced across ranks, weighted by rows, over the ranks that ran each layer (all-reduce,
      or reduce to the rank that decomposes them; :class:`StepReduction`), in buckets of at most
      ``bucket_cap_mb``, optionally as packed upper triangles and in a lower precision;
    * decompositions broadcast inside a layer's gradient-worker block on decomposition steps;
    * preconditioned gradients broadcast inside receiver groups every step when ``m < world``.

Every rank issues the same collectives in the same order (the order of the preconditioner's layer list),
which is what makes asynchronous launch safe. ``counts`` tallies collectives by kind for tests and metrics,
``payload_bytes`` the bytes they carry. The factor buckets are a pure function of the placement
(:func:`factor_entries`, :func:`make_buckets`), so a planner computes it without a process group.

All of it runs over one process group (default: the world): ranks, blocks and owners are ranks *of that
group*, translated to global ranks where torch.distributed expects them (``src``/``dst``). The block and
receiver groups are created with ``use_local_synchronization``, by their members only, so a preconditioner
over a subgroup (the data-parallel group under tensor or pipeline parallelism) never waits for ranks outside
it; a group of one rank communicates nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .assignment import LayerWork
from .options import Factor
from .state import tensor_bytes


def world_info(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(size, rank) of ``group`` (default: the world); (1, 0) when torch.distributed is not initialised.

    Raises:
        ValueError: this process is not a member of ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("process_group given, but torch.distributed is not initialised")
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the K-FAC process_group")
    return dist.get_world_size(group), rank


def pack_triu(t: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included) of a symmetric matrix, flattened: n(n+1)/2 values."""
    i, j = torch.triu_indices(t.shape[0], t.shape[1], device=t.device)
    return t[i, j]


def unpack_triu(v: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_triu` for a symmetric n×n matrix."""
    out = v.new_empty(n, n)
    i, j = torch.triu_indices(n, n, device=v.device)
    out[i, j] = v
    out[j, i] = v
    return out


@dataclass
class Bucket:
    """Factors sent together in one collective: their keys, the reduce target, elements on the wire (the
    factors, then one weight per factor and the rank's loss terms, see :class:`StepReduction`)."""

    keys: list[str] = field(default_factory=list)
    dst: int | None = None  # None: all-reduce
    numel: int = 0
    dims: list[int] = field(default_factory=list, compare=False)


def factor_entries(
    plan: Mapping[str, LayerWork], reduce: bool
) -> list[tuple[str, int, int | None]]:
    """``(key, dim, dst)`` of every factor in backward order (the last layer's factors are ready first; G
    before A), ``dst`` the decomposing rank with ``reduce``, else None (all-reduce)."""
    return [
        (f"{name}/{kind}", dim, owner if reduce else None)
        for name, w in reversed(list(plan.items()))
        for kind, dim, owner in ((Factor.G, w.g_dim, w.g_owner), (Factor.A, w.a_dim, w.a_owner))
    ]


def make_buckets(
    entries: Sequence[tuple[str, int, int | None]],
    element_size: int,
    bucket_cap_mb: float,
    symmetry_aware: bool,
) -> list[Bucket]:
    """The factor buckets: consecutive ``(key, dim, dst)`` entries with the same ``dst`` grouped while they
    fit ``bucket_cap_mb`` at ``element_size`` bytes per element (a factor larger than the cap gets its own
    bucket). ``numel`` counts ``d²`` per factor, ``d(d+1)/2`` with ``symmetry_aware``, plus one weight per
    factor and one for the rank's loss terms (the cap applies to the factors)."""
    cap = bucket_cap_mb * 2**20
    buckets: list[Bucket] = []
    size = 0  # factor elements of the last bucket
    for key, dim, dst in entries:
        numel = dim * (dim + 1) // 2 if symmetry_aware else dim * dim
        b = buckets[-1] if buckets else None
        if b is None or b.dst != dst or (b.keys and (size + numel) * element_size > cap):
            b = Bucket(dst=dst, numel=1)
            buckets.append(b)
            size = 0
        b.keys.append(key)
        b.dims.append(dim)
        b.numel += numel + 1
        size += numel
    return buckets


@dataclass(eq=False)
class InFlight:
    """A launched bucket: what :meth:`StepReduction.finish` needs to unpack it (never the source factors),
    its flat buffer and the collective's handle."""

    bucket: Bucket
    dtype: torch.dtype
    flat: torch.Tensor
    work: dist.Work


class StepReduction:
    """One step's reduction of batch factors across ranks, weighted by rows, overlapping the backward pass.

    Each rank's factor ``F`` enters the sum with a weight ``c``: its count (the rows or examples it was
    normalised by, :class:`~.state.Accumulator`), or for the keys in ``by_terms`` (the G of Linear-type
    layers under ``'expand'``) the rank's loss terms ``terms`` (``L`` summed over its backward passes).
    The result is ``Σ c F / Σ c``, the sum over the ranks that ran the layer, or over all ranks for
    ``by_terms``: the factors of one process on the pooled batch, for uneven per-rank batches and for
    layers that ran on some ranks only (an MoE expert no token of a rank reached). A bucket carries its
    factors times their weights, zeros for a factor this rank lacks, then the weights and ``terms``: its size
    is fixed by the plan, so every rank sends the same collectives whatever ran where, and a factor whose
    weights sum to 0 (no rank ran its layer) is left out of the result.

    Buckets follow a fixed plan, the same on every rank. A bucket is launched (asynchronously) as soon as
    all its factors have been added and every earlier bucket has been launched, so the launch order is
    identical on every rank even if factors became ready in a different order. Launching packs the bucket's
    factors into one flat buffer and drops them: from then on only that buffer holds them. :meth:`finish`
    launches what is left, waits, and returns ``key -> reduced factor`` for all-reduced keys and keys
    reduced to this rank, viewed out of the buffer where the layout allows.
    """

    def __init__(
        self,
        comm: Communicator,
        plan: list[Bucket],
        by_terms: frozenset[str] = frozenset(),
        terms: int = 0,
    ) -> None:
        self.comm = comm
        self.plan = plan
        self.by_terms = by_terms
        self.terms = terms
        #: Batch factors added but not yet packed into a launched bucket, and their weights.
        self.tensors: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}
        self.next = 0
        self.pending: list[InFlight] = []

    def waiting_bytes(self) -> int:
        """Bytes of the batch factors added and not yet packed (their bucket is incomplete)."""
        return tensor_bytes(*self.tensors.values())

    def inflight_bytes(self) -> int:
        """Bytes of the flat buffers of the launched buckets, not yet finished."""
        return tensor_bytes(*(f.flat for f in self.pending))

    def add(self, key: str, tensor: torch.Tensor, count: int = 1) -> None:
        """A factor is final for this step: launch every bucket that is now complete, in plan order."""
        self.hold(key, tensor, count)
        while self.next < len(self.plan) and all(
            k in self.tensors for k in self.plan[self.next].keys
        ):
            self._launch(self.plan[self.next])
            self.next += 1

    def hold(self, key: str, tensor: torch.Tensor, count: int = 1) -> None:
        """A factor is final for this step, to be sent by :meth:`finish` (launches nothing now); ``count``:
        its weight (see the class docstring; ``terms`` replaces it for ``by_terms`` keys)."""
        self.tensors[key] = tensor
        self.weights[key] = float(self.terms if key in self.by_terms else count)

    def finish(self) -> dict[str, torch.Tensor]:
        """Launch what is left, wait, and unpack."""
        if not self.comm.distributed:
            local, self.tensors = self.tensors, {}
            return local
        for b in self.plan[self.next :]:
            self._launch(b)
        self.next = len(self.plan)
        mine = []
        for f in self.pending:
            f.work.wait()
            if f.bucket.dst is None or f.bucket.dst == self.comm.rank:
                mine.append(f)
        self.pending = []
        if not mine:
            return {}
        # The weights of every bucket in one host read (one synchronisation on CUDA).
        tails = torch.cat([f.flat[-len(f.bucket.keys) - 1 :].to(torch.float64) for f in mine])
        sums = tails.tolist()
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for f in mine:  # each bucket released as soon as it is unpacked
            n = len(f.bucket.keys)
            out.update(self._unpack(f, sums[offset : offset + n], sums[offset + n]))
            offset += n + 1
        return out

    def _unpack(self, f: InFlight, weights: list[float], terms: float) -> dict[str, torch.Tensor]:
        """The reduced factors of a finished bucket: each weighted sum divided by its summed weights (in a
        factor-dtype copy when it travelled in another dtype), full factors as views of the buffer,
        triangles unpacked into new matrices; factors no rank ran are left out."""
        flat = f.flat if f.flat.dtype == f.dtype else f.flat.to(f.dtype)
        out = {}
        offset = 0
        for key, d, w in zip(f.bucket.keys, f.bucket.dims, weights):
            n = d * (d + 1) // 2 if self.comm.symmetry_aware else d * d
            part = flat[offset : offset + n]
            offset += n
            if w <= 0:
                continue
            part.div_(terms if key in self.by_terms else w)
            out[key] = unpack_triu(part, d) if self.comm.symmetry_aware else part.view(d, d)
        return out

    def _launch(self, b: Bucket) -> None:
        present = [k for k in b.keys if k in self.tensors]
        like = self.tensors[present[0]] if present else None
        tensors = []
        weights = []
        for k, d in zip(b.keys, b.dims):
            t = self.tensors.pop(k, None)
            w = self.weights.pop(k, 0.0) if t is not None else 0.0
            if t is None:
                t = (
                    torch.zeros(d, d, dtype=like.dtype, device=like.device)
                    if like is not None
                    else torch.zeros(d, d, dtype=self.comm.factor_dtype, device=self.comm.device)
                )
            elif w != 1.0:
                t = t.mul_(w)
            tensors.append(t)
            weights.append(w)
        dtype = tensors[0].dtype
        tail = torch.tensor([*weights, float(self.terms)], dtype=dtype, device=tensors[0].device)
        flat, work = self.comm._launch(b, tensors, tail)
        self.pending.append(InFlight(b, dtype, flat, work))


class Communicator:
    """Process groups and collectives for one preconditioner."""

    def __init__(
        self,
        plan: dict[str, LayerWork],
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        comm_dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.world_size, self.rank = world_info(group)
        # Global rank of each rank of the group (collectives name src/dst by global rank).
        self.global_ranks: list[int] = (
            list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
        )
        self.bucket_cap_mb = bucket_cap_mb
        self.symmetry_aware = symmetry_aware
        self.comm_dtype = comm_dtype
        self.factor_dtype = torch.float32
        self.counts: Counter[str] = Counter()
        #: Bytes of the tensors the collectives of each kind carried, tallied on every rank that took part
        #: (a broadcast counts its payload on the sender and on every receiver).
        self.payload_bytes: Counter[str] = Counter()
        self._block_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._recv_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.set_groups(plan)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        """Where the small control tensors of this group's collectives (flags, strides, checkpoint
        buffers) must live: NCCL communicates CUDA tensors only, gloo works on CPU tensors."""
        if self.distributed and dist.get_backend(self.group) == dist.Backend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_groups(self, plan: dict[str, LayerWork]) -> None:
        """Create (once) this rank's block and receiver groups. Collective over the members of each."""
        if not self.distributed or not plan:
            return
        m = len(next(iter(plan.values())).grad_workers)
        block_start = self.rank - self.rank % m
        block = tuple(range(block_start, block_start + m))
        recv = tuple(range(self.rank % m, self.world_size, m))
        # The same creation order on every rank (blocks first), as use_local_synchronization requires.
        if block not in self._block_groups:
            self._block_groups[block] = self._subgroup(block)
        if recv not in self._recv_groups:
            self._recv_groups[recv] = self._subgroup(recv)

    def _subgroup(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of ``ranks`` (ranks of this group); None for one rank: nothing to send."""
        if len(ranks) == 1:
            return None
        if len(ranks) == self.world_size:
            return self.group  # the whole group: None means the world
        group = dist.new_group(
            [self.global_ranks[r] for r in ranks], use_local_synchronization=True
        )
        assert isinstance(group, dist.ProcessGroup)
        return group

    # ---------------------------------------------------------------- factors
    def set_buckets(
        self,
        entries: Sequence[tuple[str, int, int | None]],
        element_size: int,
        factor_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Fix the factor buckets (:func:`make_buckets`): ``(key, dim, dst)`` in backward order (the order
        factors become ready, :func:`factor_entries`), ``element_size`` that of the factor dtype."""
        self.buckets: list[Bucket] = make_buckets(
            entries, element_size, self.bucket_cap_mb, self.symmetry_aware
        )
        self.factor_dtype = factor_dtype

    def start_reduction(
        self, by_terms: frozenset[str] = frozenset(), terms: int = 0
    ) -> StepReduction:
        """A new step's factor reduction over the planned buckets (weights: :class:`StepReduction`)."""
        return StepReduction(self, getattr(self, "buckets", []), by_terms, terms)

    def _launch(
        self, b: Bucket, tensors: Sequence[torch.Tensor], tail: torch.Tensor
    ) -> tuple[torch.Tensor, dist.Work]:
        """Pack ``tensors`` (the factors of ``b``, in its key order) and ``tail`` (their weights and the
        rank's terms) into one flat buffer, start its collective, and return both."""
        parts = [pack_triu(t) if self.symmetry_aware else t.reshape(-1) for t in tensors]
        flat = torch.cat([*parts, tail])
        if self.comm_dtype is not None:
            flat = flat.to(self.comm_dtype)
        kind = "factor_allreduce" if b.dst is None else "factor_reduce"
        self.counts[kind] += 1
        self.payload_bytes[kind] += tensor_bytes(flat)
        work: dist.Work | None
        if b.dst is None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            work = dist.reduce(flat, dst=self.global_ranks[b.dst], group=self.group, async_op=True)
        assert work is not None
        return flat, work

    # ---------------------------------------------------------------- broadcasts
    def broadcast_in_block(
        self, tensors: Sequence[torch.Tensor], src: int, block: tuple[int, ...]
    ) -> list[dist.Work]:
        """Start broadcasting ``tensors`` (in place) from ``src`` to the other ranks of ``block``."""
        if len(block) == 1:
            return []
        group = self._block_groups[block]
        self.counts["decomposition_broadcast"] += 1
        self.payload_bytes["decomposition_broadcast"] += tensor_bytes(*tensors)
        return [self._bcast(t, src, group) for t in tensors]

    def broadcast_grad(self, grad: torch.Tensor, work: LayerWork) -> list[dist.Work]:
        """Start broadcasting a preconditioned gradient from this rank's receiver-group gradient worker."""
        m = len(work.grad_workers)
        if not self.distributed or m == self.world_size:
            return []
        j = self.rank % m
        ranks = tuple(range(j, self.world_size, m))
        src = work.grad_workers[j]
        self.counts["grad_broadcast"] += 1
        self.payload_bytes["grad_broadcast"] += tensor_bytes(grad)
        return [self._bcast(grad, src, self._recv_groups[ranks])]

    def _bcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> dist.Work:
        work = dist.broadcast(t, src=self.global_ranks[src], group=group, async_op=True)
        assert work is not None
        return work

    def broadcast_from(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Synchronous broadcast over the whole group from its rank ``src`` (used for checkpoints only)."""
        if self.distributed:
            dist.broadcast(t, src=self.global_ranks[src], group=self.group)
        return t

    def all_reduce_max(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """Synchronous element-wise maximum over the group, in place (small host-side flags)."""
        if self.distributed:
            self.counts[kind] += 1
            self.payload_bytes[kind] += tensor_bytes(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t
