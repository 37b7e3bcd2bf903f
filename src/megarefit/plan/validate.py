"""Exact-cover validation of a plan, before any byte moves.

:func:`validate_plan` reads a plan's fields (``sources``, ``targets``, ``ops``,
``quantize``, ``columns``, ``produced``, ``ops_by_target``: :class:`PlanFields`), so it
sits below :class:`~megarefit.plan.plan.Plan` (whose ``from_dict`` re-validates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from megarefit.errors import PlanValidationError
from megarefit.layout.parallel import Box
from megarefit.plan.columns import PlanColumns, vectorized_checks
from megarefit.plan.ops import VALUE_DTYPES, VALUE_FNS, CopyOp, QuantizeStep, TensorMeta, TensorRef, squeezed_lengths
from megarefit.plan.table import OpTable


class PlanFields(Protocol):
    """What validation reads of a :class:`~megarefit.plan.plan.Plan`."""

    sources: Mapping[TensorRef, TensorMeta]
    targets: Mapping[TensorRef, TensorMeta]
    ops: Sequence[CopyOp]
    quantize: tuple[QuantizeStep, ...]

    @property
    def columns(self) -> PlanColumns: ...

    @property
    def produced(self) -> dict[TensorRef, QuantizeStep]: ...

    @property
    def ops_by_target(self) -> dict[TensorRef, tuple[CopyOp, ...]]: ...


def validate_plan(plan: PlanFields) -> None:
    """Prove the plan is safe to execute.

    Checks, for every op: both tensors are declared, both boxes lie in bounds,
    box lengths agree, the recorded kind and offsets match the boxes, and at
    least one side is a single contiguous run. For every target: op boxes plus
    declared ``zero_fill`` boxes are pairwise disjoint and their volume equals
    the target's element count, i.e. every element is written exactly once.

    The checks run on the plan's columns first (:mod:`megarefit.plan.columns`: whole
    arrays at once); ops and targets those cannot prove (transposed or viewed ops, boxes
    partial in two dims, zero-fill, quantize steps, anything wrong) are checked one by
    one, which is also what names a failure.

    Raises:
        PlanValidationError: naming the op / target and what is wrong.
    """
    checks, target_rows, targets = _suspects(plan)
    for op, src, dst in checks:
        _check_op(op, src, dst)
    produced = plan.produced
    lookup = getattr(plan.targets, "lookup", None)  # a columnar table: name only these refs' rows
    _check_quantize_steps(plan, lookup)
    _check_transforms(plan, lookup)
    if target_rows is None:
        by_target = plan.ops_by_target if targets else {}
        target_rows = [(ref, plan.targets[ref], by_target.get(ref, ())) for ref in targets]
    for ref, meta, writers in target_rows:
        _check_cover(ref, meta, writers, produced)


_OpCheck = tuple[CopyOp, "TensorMeta | None", "TensorMeta | None"]
_TargetRow = tuple[TensorRef, TensorMeta, tuple[CopyOp, ...]]


def _suspects(plan: PlanFields) -> tuple[list[_OpCheck], list[_TargetRow] | None, list[TensorRef]]:
    """What the column checks cannot prove: ``(ops with their source and target metas, target
    rows with their writers or None, target refs whose rows are still to be gathered)``. Every
    op and target when a tensor is undeclared (the per-op checks then name it)."""
    table = plan.ops if isinstance(plan.ops, OpTable) else None
    try:
        cols = plan.columns
    except KeyError:  # an undeclared tensor: the per-op checks name it
        checks = [(op, plan.sources.get(op.src), plan.targets.get(op.dst)) for op in plan.ops]
        return checks, None, list(plan.targets)
    bad_ops, odd = vectorized_checks(cols)
    if table is not None:  # single rows of the tables: no names formatted for the rest
        checks = [(table[i], table.sources.meta(int(cols.src_id[i])), table.targets.meta(int(cols.dst_id[i])))
                  for i in bad_ops.tolist()]
        return checks, _odd_targets(table, odd), []
    checks = [(op, plan.sources.get(op.src), plan.targets.get(op.dst))
              for op in (plan.ops[i] for i in bad_ops.tolist())]
    names = list(plan.targets)
    return checks, None, [names[i] for i in odd.tolist()]


def _check_quantize_steps(plan: PlanFields, lookup: Any) -> None:
    """Every quantize step's staging, float8 weight and float32 block scales are declared with
    matching shapes."""
    quantized = lookup([r for q in plan.quantize for r in (q.staging, q.weight, q.scale)]) if lookup else plan.targets
    for step in plan.quantize:
        staging, weight, scale = (quantized.get(r) for r in (step.staging, step.weight, step.scale))
        if staging is None or weight is None or scale is None:
            raise PlanValidationError(f"quantize step for {step.weight}: staging / weight / scale not declared")
        want_scale = tuple(staging.shape[:-2]) + tuple(-(-n // b) for n, b in zip(staging.shape[-2:], step.block))
        if len(staging.shape) < 2 or weight.shape != staging.shape or weight.dtype != "float8_e4m3fn" or (
                scale.shape != want_scale or scale.dtype != "float32"):
            raise PlanValidationError(f"quantize step for {step.weight}: staging {staging.shape} -> float8 "
                                      f"{weight.dtype} {weight.shape} and float32 scales {scale.dtype} {scale.shape} "
                                      f"(expected {want_scale})")


def _check_cover(ref: TensorRef, meta: TensorMeta, writers: tuple[CopyOp, ...],
                 produced: Mapping[TensorRef, QuantizeStep]) -> None:
    """Target ``ref`` is written exactly once per element: by its quantize / value step, or by
    its ops' boxes plus its ``zero_fill`` boxes, in bounds, disjoint, covering it."""
    if ref in produced:
        if writers:
            raise PlanValidationError(f"target {ref}: written by ops and by its quantize / value step")
        return
    entries = [(op.dst_box, str(op.src)) for op in writers] + [(b, "zero fill") for b in meta.zero_fill]
    for b, who in entries:
        if not b.within(meta.shape):
            raise PlanValidationError(f"target {ref}: box {b} from {who} outside shape {meta.shape}")
    _check_disjoint(ref, entries)
    covered = sum(b.numel for b, _ in entries)
    if covered != meta.numel:
        raise PlanValidationError(
            f"target {ref}: ops cover {covered} of {meta.numel} elements (shape {meta.shape})"
        )


def _check_transforms(plan: PlanFields, lookup: Any) -> None:
    """Every value step's staging and target are declared, of one shape, the function known and the
    target of its dtype (:data:`~megarefit.plan.ops.VALUE_DTYPES`: float32, or the staging's)."""
    steps = getattr(plan, "transforms", ())
    if not steps:
        return
    metas = lookup([r for t in steps for r in (t.staging, t.target)]) if lookup else plan.targets
    for t in steps:
        staging, target = metas.get(t.staging), metas.get(t.target)
        if staging is None or target is None:
            raise PlanValidationError(f"value step for {t.target}: staging / target not declared")
        dtype = VALUE_DTYPES.get(t.fn) or staging.dtype
        if t.fn not in VALUE_FNS or staging.shape != target.shape or target.dtype != dtype:
            raise PlanValidationError(f"value step for {t.target}: {t.fn!r} (known: {sorted(VALUE_FNS)}) from "
                                      f"{staging.dtype} {staging.shape} into {target.dtype} {target.shape} "
                                      f"(expected the same shape, {dtype})")


def _odd_targets(table: Any, odd: Any) -> list[_TargetRow]:
    """``(ref, meta, ops writing it)`` for target rows ``odd`` of a columnar plan: single rows
    when they are few, the whole materialized plan when they are many (cheaper per op)."""
    rows = odd.tolist()
    if not rows:
        return []
    dst = table.columns.dst_id
    mask = torch.zeros(len(table.targets), dtype=torch.bool)
    mask[odd] = True
    ops = torch.nonzero(mask[dst]).flatten()
    every = table.materialized if len(ops) > len(table) // 10 else table  # all at once, or one row at a time
    by: dict[int, list[CopyOp]] = {t: [] for t in rows}
    for i, t in zip(ops.tolist(), dst[ops].tolist()):
        by[t].append(every[i])
    return [(table.targets.ref(t), table.targets.meta(t), tuple(by[t])) for t in rows]


def _check_op(op: CopyOp, src: TensorMeta | None, dst: TensorMeta | None) -> None:
    if src is None or dst is None:
        raise PlanValidationError(f"op {op.src} -> {op.dst}: tensor not declared in plan")
    if not op.src_box.within(src.shape):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: source box {op.src_box} outside shape {src.shape}")
    if not op.dst_box.within(dst.shape):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: target box {op.dst_box} outside shape {dst.shape}")
    if op.transpose:
        squeezed = _squeeze_leading(op.src_box.lengths)
        if len(squeezed) != 2 or squeezed[::-1] != _squeeze_leading(op.dst_box.lengths):
            raise PlanValidationError(f"op {op.src} -> {op.dst}: transposed box lengths do not match: "
                                      f"{op.src_box.lengths} vs {op.dst_box.lengths}")
    elif _long_dims(op.src_box.lengths) != _long_dims(op.dst_box.lengths):
        raise PlanValidationError(
            f"op {op.src} -> {op.dst}: box lengths differ: {op.src_box.lengths} vs {op.dst_box.lengths}"
        )
    src_run, dst_run = op.src_box.is_contiguous_in(src.shape), op.dst_box.is_contiguous_in(dst.shape)
    if not (src_run or dst_run):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: both boxes are strided ({op.src_box}, {op.dst_box})")
    want = "contiguous" if src_run and dst_run and not op.transpose else "scratch"
    if op.kind != want or op.src_offset != op.src_box.flat_offset(src.shape) or (
        op.dst_offset != op.dst_box.flat_offset(dst.shape)
    ):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: kind/offsets inconsistent with its boxes")


def _check_disjoint(ref: TensorRef, entries: list[tuple[Box, str]]) -> None:
    active: list[tuple[Box, str]] = []
    for box, who in sorted(entries, key=lambda e: e[0].offsets):
        start = box.offsets[0] if box.offsets else 0
        active = [(b, w) for b, w in active if not b.offsets or b.offsets[0] + b.lengths[0] > start]
        for other, other_who in active:
            if box.overlaps(other):
                raise PlanValidationError(
                    f"target {ref}: box {box} from {who} overlaps box {other} from {other_who}"
                )
        active.append((box, who))


def _long_dims(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """``lengths`` without its length-1 dims (the elements' row-major order is unchanged)."""
    return tuple(n for n in lengths if n != 1)


def _squeeze_leading(lengths: tuple[int, ...], keep: int = 2) -> tuple[int, ...]:
    """``lengths`` without leading, then trailing, 1s, keeping at least ``keep`` dims (a box
    may carry length-1 dims the other side lacks: a FusedMoE expert slot in front, gpt-oss's
    gate/up interleave behind); row-major order is the same with or without them."""
    return squeezed_lengths(lengths, keep)


__all__ = ["PlanFields", "validate_plan"]
