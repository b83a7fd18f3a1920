"""WHERE K-FAC work runs: KAISA's gradient-worker groups and the placement of factors on ranks.

Vocabulary (KAISA §3.1): each layer has ``m = max(1, round(grad_worker_fraction · world))`` *gradient
workers*. Ranks are split into contiguous *blocks* ``[b·m, (b+1)·m)`` (the decomposition-broadcast groups);
each layer lives in one block: one rank of the block decomposes A, one decomposes G (the same rank when
``colocate_factors``), and every rank of the block receives both decompositions and preconditions the layer.
The *receiver groups* are strided ``[j, j+m, j+2m, ...]``: each holds one rank of every block, so the layer's
gradient worker in group j broadcasts the preconditioned gradient to the rest of group j.

    COMM-OPT: m = world (one block; nothing sent between decomposition steps)
    MEM-OPT:  m = 1 (every rank its own block; a preconditioned-gradient broadcast every step)

Placement is deterministic (ties broken by layer order, then rank), so every rank computes the same plan
without communicating. :func:`assign` is the one placement rule: the preconditioner places its layers with it,
and ``kfac-bench plan`` places a recipe's layers with it, so a plan's placement is the run's.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .options import (
    AssignmentStrategy,
    DistributedStrategy,
    Placement,
    parse_grad_worker_fraction,
)


class Shaped(Protocol):
    """What placement reads of a layer: its factor sizes (A is ``a_dim × a_dim``, G is ``g_dim × g_dim``)
    and whether it is ``spatial`` (a convolution, whose factors may cost differently to decompose). A
    scanned :class:`~kfac_bench.kfac.LayerSpec` and the preconditioner's layer state have them."""

    @property
    def name(self) -> str: ...
    @property
    def a_dim(self) -> int: ...
    @property
    def g_dim(self) -> int: ...
    @property
    def spatial(self) -> bool: ...


@dataclass(frozen=True)
class LayerWork:
    """Where one layer's K-FAC work runs."""

    name: str
    a_dim: int
    g_dim: int
    a_owner: int
    g_owner: int
    grad_workers: tuple[int, ...]


def grad_workers_per_layer(fraction: float | DistributedStrategy | str, world_size: int) -> int:
    """``max(1, round(fraction · world))``, checked to split the world into equal blocks.

    ``fraction`` is anything :func:`~kfac_bench.kfac.options.parse_grad_worker_fraction` accepts.

    Raises:
        ValueError: naming the valid fractions for this world size.
    """
    parsed = parse_grad_worker_fraction(fraction)
    if isinstance(parsed, DistributedStrategy):
        parsed = parsed.fraction(world_size)
    m = max(1, round(parsed * world_size))
    if world_size % m != 0:
        valid = ", ".join(
            f"{d}/{world_size}" for d in range(1, world_size + 1) if world_size % d == 0
        )
        raise ValueError(
            f"grad_worker_fraction={fraction} gives {m} gradient workers per layer, which does not divide "
            f"the world size {world_size}; valid fractions here: {valid}"
        )
    return m


def factor_cost(n: int, strategy: AssignmentStrategy) -> float:
    """Cost model of one n×n factor: n³ (decomposition time) or n² (memory)."""
    return float(n) ** (3 if strategy is AssignmentStrategy.COMPUTE else 2)


def lpt(costs: Sequence[float], bins: int) -> list[int]:
    """Greedy longest-processing-time: the largest job first, each to the least-loaded bin.

    Returns the bin of every job. Deterministic: equal costs keep their input order, equal loads go to
    the lowest bin. The makespan is within 4/3 - 1/(3·bins) of the optimum (Graham 1969).
    """
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(bins)]
    out = [0] * len(costs)
    for i in order:
        load, b = heapq.heappop(heap)
        out[i] = b
        heapq.heappush(heap, (load + costs[i], b))
    return out


def assign(
    layers: Sequence[Shaped],
    world_size: int,
    grad_worker_fraction: float | DistributedStrategy | str,
    cost: Callable[[int, bool], float],
    strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
    placement: Placement | str = Placement.LPT,
) -> dict[str, LayerWork]:
    """The placement of every layer's decompositions and gradient workers.

    Args:
        layers: in registration order (ties are broken by it).
        world_size: ranks of the K-FAC process group.
        grad_worker_fraction: see :func:`grad_workers_per_layer`.
        cost: ``cost(n, spatial)``, the decomposition cost of an n×n factor under the ``compute`` strategy:
            the second-order method's ``decomposition_cost`` (low-rank factors cost far less than ``n³``).
        strategy: price factors by ``cost`` (``compute``) or by ``n²`` (``memory``).
        colocate_factors: decompose a layer's A and G on the same rank.
        placement: KAISA's LPT or SC20's round robin.
    """
    strategy, placement = AssignmentStrategy.parse(strategy), Placement.parse(placement)
    m = grad_workers_per_layer(grad_worker_fraction, world_size)
    if placement is Placement.ROUND_ROBIN:
        owners = _round_robin(
            layers, world_size, split=m == world_size and world_size > len(layers)
        )
    else:
        owners = _lpt_two_level(layers, world_size, m, strategy, colocate_factors, cost)
    plan = {}
    for layer, (a_owner, g_owner) in zip(layers, owners):
        block = a_owner // m
        plan[layer.name] = LayerWork(
            layer.name,
            layer.a_dim,
            layer.g_dim,
            a_owner,
            g_owner,
            tuple(range(block * m, (block + 1) * m)),
        )
    return plan


def _round_robin(layers: Sequence[Shaped], world_size: int, split: bool) -> list[tuple[int, int]]:
    """SC20's rule: cycle through ranks one layer at a time, or one factor at a time (A then G) when
    there are more ranks than layers (SC20 §IV; its code cycles ranks with ``itertools.cycle``)."""
    if split:
        return [((2 * i) % world_size, (2 * i + 1) % world_size) for i in range(len(layers))]
    return [(i % world_size, i % world_size) for i in range(len(layers))]


def _lpt_two_level(
    layers: Sequence[Shaped],
    world_size: int,
    m: int,
    strategy: AssignmentStrategy,
    colocate: bool,
    cost: Callable[[int, bool], float],
) -> list[tuple[int, int]]:
    """Layers to blocks by LPT on their total cost, then factors (or whole layers) to the block's ranks."""

    def price(n: int, spatial: bool) -> float:
        if strategy is AssignmentStrategy.COMPUTE:
            return cost(n, spatial)
        return factor_cost(n, strategy)

    a_cost = [price(layer.a_dim, layer.spatial) for layer in layers]
    g_cost = [price(layer.g_dim, layer.spatial) for layer in layers]
    blocks = lpt([a + g for a, g in zip(a_cost, g_cost)], world_size // m)
    owners: list[tuple[int, int]] = [(0, 0)] * len(layers)
    for b in range(world_size // m):
        members = [i for i, blk in enumerate(blocks) if blk == b]
        if colocate:
            ranks = lpt([a_cost[i] + g_cost[i] for i in members], m)
            for i, r in zip(members, ranks):
                owners[i] = (b * m + r, b * m + r)
        else:
            ranks = lpt([c for i in members for c in (a_cost[i], g_cost[i])], m)
            for k, i in enumerate(members):
                owners[i] = (b * m + ranks[2 * k], b * m + ranks[2 * k + 1])
    return owners


def summary(plan: dict[str, LayerWork], world_size: int, strategy: AssignmentStrategy) -> str:
    """A readable per-rank table: factors decomposed, their cost share, and decomposition memory held."""
    load = [0.0] * world_size
    count = [0] * world_size
    held = [0] * world_size  # elements of decompositions held (A and G eigenbases) per rank
    for w in plan.values():
        for dim, owner in ((w.a_dim, w.a_owner), (w.g_dim, w.g_owner)):
            load[owner] += factor_cost(dim, strategy)
            count[owner] += 1
        for r in w.grad_workers:
            held[r] += w.a_dim**2 + w.g_dim**2
    total = sum(load) or 1.0
    lines = [f"{'rank':>4} {'factors':>7} {'load %':>7} {'decomp MB (fp32)':>17}"]
    for r in range(world_size):
        lines.append(
            f"{r:>4} {count[r]:>7} {100 * load[r] / total:>6.1f}% {held[r] * 4 / 2**20:>17.2f}"
        )
    lines.append(f"makespan/mean load: {max(load) / (total / world_size):.3f}")
    return "\n".join(lines)
