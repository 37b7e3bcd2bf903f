"""Streamed refits: a plan cut into groups of whole layers, pulled through one bounded ring.

A staged receiver holds the worker's whole share (its arena) between cycles: a vLLM worker
then needs its weights twice. A streamed receiver holds one registered **ring** buffer that
shares its ``memory_budget`` with the transport's scratch (1/8 of the budget by default):
group ``k`` is pulled into the ring and handed over, then group ``k + 1`` lands, so the
extra memory is at most the budget, whatever the model's size. Groups are packed to at
most half the ring and placed at alternate ends of it, so two consecutive groups never
share a byte (group ``k + 1`` can land while group ``k`` is installed); a layer larger
than half the ring forms a group of its own, up to the whole ring::

    plan targets, in order:  embed | layer 0 | layer 1 | layer 2 | ... | norm, lm_head
    groups (whole layers):   [embed, layer 0] [layer 1, layer 2] [layer 3] ...
    ring (bytes):            |group 0, 2, 4 ->      ...      <- group 1, 3, 5|

A group never splits one target (one HF tensor or vLLM parameter) nor one layer: a layer's
tensors (its FP8 staging, weight and scale targets too) land together, and vLLM's layerwise
reload, which keeps a reference to each tensor until its layer is complete, has processed
the layer before its bytes are overwritten. Targets are laid out at 256-byte aligned
offsets, in plan order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from megarefit.errors import MegarefitError
from megarefit.plan import Plan, TensorRef, digest_of, validate_plan
from megarefit.transport.execute import torch_dtype

GiB = 1 << 30
ALIGN = 256  # bytes: every target starts on a 256-byte boundary of its slot
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


SCRATCH_SHARE = 8  # a streamed receiver's default scratch budget: 1/8 of its memory budget


class MemoryBudgetError(MegarefitError):
    """A memory budget too small for the model's largest layer (names the layer and its bytes);
    ``ring_bytes_needed``: the ring that layer needs."""

    def __init__(self, message: str, ring_bytes_needed: int = 0):
        super().__init__(message)
        self.ring_bytes_needed = ring_bytes_needed


def layer_of(name: str) -> int | None:
    """The decoder layer a target belongs to (``model.layers.7.mlp...`` -> 7; MTP layers are
    numbered after the decoder's), or ``None`` (embedding, final norm, ``lm_head``)."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def target_bytes(plan: Plan, ref: TensorRef) -> int:
    """Bytes a target takes in the ring (its dtype's bytes, rounded up to :data:`ALIGN`)."""
    meta = plan.targets[ref]
    return _aligned(meta.numel * torch_dtype(meta.dtype).itemsize)


def layer_runs(plan: Plan) -> list[tuple[int | None, list[TensorRef]]]:
    """The plan's targets in order, cut where the layer changes: ``[(layer, targets), ...]``."""
    runs: list[tuple[int | None, list[TensorRef]]] = []
    for ref in plan.targets:
        layer = layer_of(ref.name)
        if not runs or runs[-1][0] != layer:
            runs.append((layer, []))
        runs[-1][1].append(ref)
    return runs


def _sized_runs(plan: Plan, direct: frozenset[TensorRef]) -> list[tuple[int | None, list[TensorRef], int]]:
    """:func:`layer_runs` with each run's ring bytes (``direct`` targets take none)."""
    return [(layer, refs, sum(target_bytes(plan, r) for r in refs if r not in direct))
            for layer, refs in layer_runs(plan)]


def ring_needed(plan: Plan, direct: frozenset[TensorRef] = frozenset()) -> int:
    """The ring bytes of the plan's largest layer (or of its tensors outside the layers), the
    smallest ring :func:`stream_groups` accepts; ``direct`` targets take none."""
    return max(run[2] for run in _sized_runs(plan, direct))


def budget_for(ring_bytes: int) -> int:
    """The smallest memory budget whose ring holds ``ring_bytes`` once its scratch share
    (1/:data:`SCRATCH_SHARE`) is set aside (bytes)."""
    return -(-ring_bytes * SCRATCH_SHARE // (SCRATCH_SHARE - 1)) + ALIGN


def default_memory_budget(plan: Plan) -> int:
    """The larger of 1 GiB and the budget whose ring holds the plan's two largest layers
    (so that consecutive groups never share ring bytes), in bytes."""
    sizes = sorted((sum(target_bytes(plan, r) for r in refs) for _, refs in layer_runs(plan)), reverse=True)
    return max(GiB, budget_for(sum(sizes[:2])))


@dataclass(frozen=True)
class StreamGroup:
    """One group: a sub-plan of whole layers and each target's byte offset in the ring."""

    plan: Plan
    offsets: dict[TensorRef, int]  # bytes from the ring's start
    start: int  # the group's first byte in the ring
    nbytes: int  # bytes of the ring this group uses, from ``start``

    def views(self, ring: torch.Tensor) -> dict[TensorRef, torch.Tensor]:
        """The group's targets as views of ``ring`` (a uint8 tensor), in plan order; targets
        written directly into the consumer's tensors (no ring offset) are left out."""
        out = {}
        for ref, meta in self.plan.targets.items():
            if ref not in self.offsets:
                continue
            start = self.offsets[ref]
            n = meta.numel * torch_dtype(meta.dtype).itemsize
            out[ref] = ring[start:start + n].view(torch_dtype(meta.dtype)).view(meta.storage_shape or meta.shape)
        return out

    def overlaps(self, other: StreamGroup) -> bool:
        """Whether the two groups share ring bytes."""
        return self.start < other.start + other.nbytes and other.start < self.start + self.nbytes


def _sub_plan(plan: Plan, refs: list[TensorRef], k: int, ring_bytes: int, salt: str = "") -> Plan:
    """``plan`` restricted to targets ``refs`` (every op writing them, the sources those read,
    their quantize and value steps); validated: it covers each of its targets exactly once."""
    return sub_plan(plan, refs, digest_of(plan.digest, "stream", ring_bytes, k, salt))


def sub_plan(plan: Plan, refs: list[TensorRef], digest: str) -> Plan:
    """``plan`` restricted to targets ``refs`` (every op writing them, the sources those read,
    their quantize and value steps), with ``digest`` (its identity in the caches: callers derive
    it from the plan's digest and what they kept); validated: it covers each of its targets
    exactly once.

    Raises:
        PlanError: ``refs`` are not targets of ``plan``, or the sub-plan does not validate."""
    by_target = plan.ops_by_target
    ops = tuple(op for ref in refs for op in by_target.get(ref, ()))
    targets = {ref: plan.targets[ref] for ref in refs}
    sources = {op.src: plan.sources[op.src] for op in ops}
    quantize = tuple(q for q in plan.quantize if q.weight in targets)
    transforms = tuple(t for t in plan.transforms if t.target in targets)
    sub = Plan(plan.direction, plan.dims, plan.layout, plan.dtype, sources, targets, ops, digest, quantize,
               transforms)
    validate_plan(sub)
    return sub


def _pack(runs: list[tuple[int | None, list[TensorRef], int]], ring_bytes: int) -> list[list[TensorRef]]:
    """Consecutive runs packed into groups of at most half the ring; a run larger than that
    is a group of its own."""
    groups: list[list[TensorRef]] = []
    used = ring_bytes  # start a new group at the first run
    for _, refs, need in runs:
        if used + need > ring_bytes // 2:
            groups.append([])
            used = 0
        groups[-1].extend(refs)
        used += need
    return groups


def stream_groups(plan: Plan, ring_bytes: int, direct: frozenset[TensorRef] = frozenset(),
                  salt: str = "") -> list[StreamGroup]:
    """Cut ``plan`` into groups of consecutive whole layers for a ring of ``ring_bytes``: even
    groups start at the ring's start, odd groups end at its end. A plan whose share fits the
    ring is one group in a ring of the share. Targets in ``direct`` (pulled straight into the
    consumer's own tensors) stay in their layer's group but take no ring bytes; ``salt``
    (e.g. which tensors those are) goes into the groups' digests.

    Raises:
        MemoryBudgetError: a layer (or the embedding / head) needs more than the ring (the
            largest such is named).
    """
    def size(ref: TensorRef) -> int:
        return 0 if ref in direct else target_bytes(plan, ref)

    runs = _sized_runs(plan, direct)
    layer, refs, need = max(runs, key=lambda run: run[2])
    if need > ring_bytes:  # the largest names the budget that fits every run
        what = "the tensors outside the layers" if layer is None else f"layer {layer}"
        raise MemoryBudgetError(f"{what} ({refs[0].name}, ...): {need} bytes, more than the ring "
                                f"of {ring_bytes} bytes", need)
    total = sum(run[2] for run in runs)
    packed = [[r for _, refs, _ in runs for r in refs]] if total <= ring_bytes else _pack(runs, ring_bytes)
    ring_bytes = min(ring_bytes, total)  # a budget above the share: one group, a ring of the share
    out = []
    for k, group in enumerate(packed):
        nbytes = sum(size(r) for r in group)
        start = 0 if k % 2 == 0 else (ring_bytes - nbytes) // ALIGN * ALIGN
        offsets, at = {}, start
        for ref in group:
            if ref not in direct:
                offsets[ref] = at
                at += target_bytes(plan, ref)
        out.append(StreamGroup(_sub_plan(plan, group, k, ring_bytes, salt), offsets, start, nbytes))
    return out


def regroup(groups: list[StreamGroup], plan: Plan) -> list[StreamGroup]:
    """The same groups (targets, ring offsets) with their sub-plans cut from ``plan`` instead: the
    same targets read from other holders (a failover re-planned them); no memory moves.

    Raises:
        PlanError: a group's targets are not targets of ``plan``."""
    return [replace(g, plan=sub_plan(plan, list(g.plan.targets), digest_of(plan.digest, "regroup", g.plan.digest)))
            for g in groups]


__all__ = ["ALIGN", "SCRATCH_SHARE", "GiB", "MemoryBudgetError", "StreamGroup", "budget_for", "default_memory_budget",
           "layer_of", "layer_runs", "regroup", "ring_needed", "stream_groups", "sub_plan", "target_bytes"]
