"""Streamed refits: a plan cut into groups of whole layers, pulled through a ring of two slots.

A staged receiver holds the worker's whole share (its arena) between cycles: a vLLM worker
then needs its weights twice. A streamed receiver holds two **ring slots** sharing its
``memory_budget`` with the transport's scratch (1/8 of the budget by default): group ``k``
is pulled into slot ``k % 2`` and handed over, then group ``k + 1`` lands in the other
slot, so the extra memory is at most the budget, whatever the model's size::

    plan targets, in order:  embed | layer 0 | layer 1 | layer 2 | ... | norm, lm_head
    groups (whole layers, each <= slot):  [embed, layer 0] [layer 1, layer 2] [layer 3] ...
    ring:        slot 0 <- group 0, 2, 4, ...      slot 1 <- group 1, 3, 5, ...

A group never splits one target (one HF tensor or vLLM parameter) nor one layer: a layer's
tensors (its FP8 staging, weight and scale targets too) land together. Targets are laid
out in a slot at 256-byte aligned offsets, in plan order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    ``slot_bytes_needed``: the slot that layer needs."""

    def __init__(self, message: str, slot_bytes_needed: int = 0):
        super().__init__(message)
        self.slot_bytes_needed = slot_bytes_needed


def layer_of(name: str) -> int | None:
    """The decoder layer a target belongs to (``model.layers.7.mlp...`` -> 7; MTP layers are
    numbered after the decoder's), or ``None`` (embedding, final norm, ``lm_head``)."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def target_bytes(plan: Plan, ref: TensorRef) -> int:
    """Bytes a target takes in a slot (its dtype's bytes, rounded up to :data:`ALIGN`)."""
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


def budget_for(slot_bytes: int) -> int:
    """The memory budget whose ring slots hold ``slot_bytes`` once its scratch share is set aside."""
    return -(-2 * slot_bytes * SCRATCH_SHARE // (SCRATCH_SHARE - 1)) + ALIGN


def default_memory_budget(plan: Plan) -> int:
    """The larger of 1 GiB and the budget whose slots hold the plan's largest layer (bytes)."""
    biggest = max((sum(target_bytes(plan, r) for r in refs) for _, refs in layer_runs(plan)), default=0)
    return max(GiB, budget_for(biggest))


@dataclass(frozen=True)
class StreamGroup:
    """One group: a sub-plan of whole layers, its ring slot and each target's byte offset there."""

    plan: Plan
    slot: int  # 0 or 1
    offsets: dict[TensorRef, int]  # bytes from the slot's start
    nbytes: int  # bytes of the slot this group uses

    def views(self, slot: torch.Tensor) -> dict[TensorRef, torch.Tensor]:
        """The group's targets as views of ``slot`` (a uint8 tensor), in plan order."""
        out = {}
        for ref, meta in self.plan.targets.items():
            start = self.offsets[ref]
            n = meta.numel * torch_dtype(meta.dtype).itemsize
            out[ref] = slot[start:start + n].view(torch_dtype(meta.dtype)).view(meta.shape)
        return out


def _sub_plan(plan: Plan, refs: list[TensorRef], k: int, slot_bytes: int) -> Plan:
    """``plan`` restricted to targets ``refs`` (every op writing them, the sources those read,
    their quantize steps); validated: it covers each of its targets exactly once."""
    by_target = plan.ops_by_target
    ops = tuple(op for ref in refs for op in by_target.get(ref, ()))
    targets = {ref: plan.targets[ref] for ref in refs}
    sources = {op.src: plan.sources[op.src] for op in ops}
    quantize = tuple(q for q in plan.quantize if q.weight in targets)
    sub = Plan(plan.direction, plan.dims, plan.layout, plan.dtype, sources, targets, ops,
               digest_of(plan.digest, "stream", slot_bytes, k), quantize)
    validate_plan(sub)
    return sub


def stream_groups(plan: Plan, slot_bytes: int) -> list[StreamGroup]:
    """Cut ``plan`` into groups of consecutive whole layers, each fitting one ring slot of
    ``slot_bytes``; group ``k`` uses slot ``k % 2``.

    Raises:
        MemoryBudgetError: a layer (or the embedding / head) needs more than one slot (the
            largest such is named).
    """
    runs = [(layer, refs, sum(target_bytes(plan, r) for r in refs)) for layer, refs in layer_runs(plan)]
    layer, refs, need = max(runs, key=lambda run: run[2])
    if need > slot_bytes:  # the largest names the budget that fits every run
        what = "the tensors outside the layers" if layer is None else f"layer {layer}"
        raise MemoryBudgetError(f"{what} ({refs[0].name}, ...): {need} bytes, more than one ring slot "
                                f"of {slot_bytes} bytes", need)
    groups: list[list[TensorRef]] = []
    used = slot_bytes + 1  # start a new group at the first run
    for _, refs, need in runs:
        if used + need > slot_bytes:
            groups.append([])
            used = 0
        groups[-1].extend(refs)
        used += need
    out = []
    for k, refs in enumerate(groups):
        offsets, at = {}, 0
        for ref in refs:
            offsets[ref] = at
            at += target_bytes(plan, ref)
        out.append(StreamGroup(_sub_plan(plan, refs, k, slot_bytes), k % 2, offsets, at))
    return out


__all__ = ["ALIGN", "SCRATCH_SHARE", "GiB", "MemoryBudgetError", "StreamGroup", "budget_for", "default_memory_budget",
           "layer_of", "layer_runs", "stream_groups", "target_bytes"]
