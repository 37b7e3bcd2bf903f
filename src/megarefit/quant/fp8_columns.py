"""Block-FP8 planning on a columnar plan: :func:`~megarefit.quant.planning.plan_fp8`'s
rules as whole-column operations.

Same decisions, same tensors, same ops as the per-op version (tests/test_plan_columns.py
compares them), with tables instead of objects::

    per op        misaligned = quantized target and (transposed / viewed, not 2-D, or a
                  row / column run off the block grid in source or target)
    per source    has a reason = feeds a misaligned op (or, after the fix point below,
                  feeds a receiver-quantized target and a trainer-quantized one)
    per target    trainer-quantized = quantized and none of its sources has a reason

    sources   s -> [s as float8_e4m3fn, s_scale_inv]   where s feeds a trainer target
    targets   t -> [t float8, t_scale_inv]              trainer-quantized
              t -> [t:staging, t float8, t_scale_inv]   receiver-quantized (+ a QuantizeStep)
    ops       value ops keep their boxes (1 byte per element), a scale op per value op
              (boxes divided by the block, 4 bytes), staging ops keep everything

Only the receiver-quantized targets' reasons are built one op at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megarefit.plan import Plan, QuantizeStep, TensorMeta, TensorRef, digest_of, validate_plan
from megarefit.plan.columns import PlanColumns, contiguous_runs, flat_offsets
from megarefit.plan.table import OpTable, TensorGroup, TensorTable
from megarefit.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Format
from megarefit.quant.grid import misaligned
from megarefit.quant.scheme import quantized_weight_templates

_F8 = "float8_e4m3fn"
_I64 = torch.int64


def _grid(off: torch.Tensor, n: torch.Tensor, size: torch.Tensor, b: int) -> torch.Tensor:
    """Per run, whether ``[off, off + n)`` of a ``size``-long dim starts on the ``b`` grid and ends on it
    or at the dim's end."""
    return (off % b == 0) & ((n % b == 0) | (off + n == size))


def _variant(g: TensorGroup, v: int, fmt: Fp8Format, staging_suffix: str,
             metas: dict[tuple[TensorMeta, int], TensorMeta]) -> TensorGroup:
    """0: as is, 1: float8, 2: its float32 scales, 3: receiver staging (targets). ``metas``
    caches the new metas (~10^5 groups, a few dozen shapes)."""
    m = g.meta
    if v in (0, 3):
        return g if v == 0 else TensorGroup(g.rank, g.spec, g.hf_index, m, staging_suffix)
    new = metas.get((m, v))
    if new is None:
        new = metas[(m, v)] = (TensorMeta(m.shape, _F8) if v == 1 else
                               TensorMeta(fmt.scale_shape(m.shape), "float32"))
    return TensorGroup(g.rank, g.spec, g.hf_index, new, SCALE_SUFFIX if v == 2 else "")


def _table(old: TensorTable, rows: torch.Tensor, variant: torch.Tensor, fmt: Fp8Format, staging_suffix: str,
           ) -> TensorTable:
    """Rows ``rows`` of ``old`` in variant ``variant`` (new groups ``4 * group + variant``)."""
    kinds = 4
    new_group = old.group[rows] * kinds + variant
    used = torch.unique(new_group).tolist()
    remap = torch.full((len(old.groups) * kinds,), -1, dtype=_I64)
    remap[torch.tensor(used, dtype=_I64)] = torch.arange(len(used))
    metas: dict[tuple[TensorMeta, int], TensorMeta] = {}
    groups = [_variant(old.groups[u // kinds], u % kinds, fmt, staging_suffix, metas) for u in used]
    return TensorTable(groups, remap[new_group], old.layer[rows], old.expert[rows])


class _Split(NamedTuple):
    """Where each quantized target is quantized, and why (boolean columns)."""

    mis: torch.Tensor  # [n_ops]: a misaligned op into a quantized target
    src_bad: torch.Tensor  # [n_sources]: feeds a misaligned op
    feeds: torch.Tensor  # [n_sources]: moved a target to the receiver in the fix point (feeds both kinds)
    trainer: torch.Tensor  # [n_targets]: trainer-quantized
    receiver: torch.Tensor  # [n_targets]: receiver-quantized
    fp8_src: torch.Tensor  # [n_sources]: served as FP8 (feeds a trainer-quantized target)


def _quantized_targets(plan: Plan) -> torch.Tensor:
    """``[n_targets]`` bool: the target is a quantized weight (of the model's FP8 templates)."""
    T = plan.ops.targets  # type: ignore[attr-defined]
    templates = quantized_weight_templates(plan.dims)
    q_group = torch.tensor([g.spec.hf[g.hf_index] in templates for g in T.groups] or [False], dtype=torch.bool)
    return q_group[T.group] if len(T) else torch.zeros(0, dtype=torch.bool)


def _bad_ops(c: PlanColumns, S: TensorTable, T: TensorTable, fmt: Fp8Format) -> torch.Tensor:
    """``[n_ops]`` bool: the op cannot move whole FP8 blocks (transposed / viewed, not 2-D, or a row /
    column run off the block grid in source or target), whatever its target."""
    width = c.src_off.shape[1]
    s_ndim = torch.tensor([len(g.meta.shape) for g in S.groups] or [0])[S.group]
    t_ndim = torch.tensor([len(g.meta.shape) for g in T.groups] or [0])[T.group]
    flat2 = (s_ndim[c.src_id] == 2) & (t_ndim[c.dst_id] == 2)
    bad = c.special | ~flat2
    s_size, d_size = c.src_shape[c.src_id], c.dst_shape[c.dst_id]
    for d, b in enumerate(fmt.block):
        col = width - 2 + d
        so, do, n = c.src_off[:, col], c.dst_off[:, col], c.src_len[:, col]
        ends = (so + n == s_size[:, col]) & (do + n == d_size[:, col])
        bad |= ~(_grid(so, n, s_size[:, col], b) & _grid(do, n, d_size[:, col], b)) | ((n % b != 0) & ~ends)
    return bad


def _split_targets(c: PlanColumns, q_t: torch.Tensor, mis: torch.Tensor, n_src: int, n_tgt: int) -> _Split:
    """Trainer- or receiver-quantized, per quantized target ``q_t``: receiver where a source has a
    reason (feeds a misaligned op ``mis``, or also an unquantized target), then, to a fix point, where a
    source also feeds a receiver one."""
    src_bad = torch.zeros(n_src, dtype=torch.bool)
    src_bad[c.src_id[mis]] = True
    feeds = torch.zeros(n_src, dtype=torch.bool)  # "also feeds a tensor it cannot serve as FP8 for"
    feeds[c.src_id[~q_t[c.dst_id]]] = True  # an unquantized one (gated DeltaNet's in_proj: b / a rows)
    t_bad = torch.zeros(n_tgt, dtype=torch.bool)
    t_bad[c.dst_id[(src_bad | feeds)[c.src_id]]] = True
    trainer = q_t & ~t_bad
    while True:
        recv_op = (q_t & ~trainer)[c.dst_id]
        bf16 = torch.zeros(n_src, dtype=torch.bool)
        bf16[c.src_id[recv_op]] = True
        hit = trainer[c.dst_id] & bf16[c.src_id]
        if not bool(hit.any()):
            break
        moved = torch.zeros(n_tgt, dtype=torch.bool)
        moved[c.dst_id[hit]] = True
        first = _first_per(c.dst_id[hit], torch.nonzero(hit).flatten(), n_tgt)  # first such op per moved target
        feeds[c.src_id[first[moved]]] = True
        trainer &= ~moved
    receiver = q_t & ~trainer
    fp8_src = torch.zeros(n_src, dtype=torch.bool)
    fp8_src[c.src_id[trainer[c.dst_id]]] = True
    return _Split(mis, src_bad, feeds, trainer, receiver, fp8_src)


def _new_sources(S: TensorTable, fp8_src: torch.Tensor, fmt: Fp8Format, staging_suffix: str,
                 ) -> tuple[TensorTable, torch.Tensor]:
    """The new sources: s, then s_scale_inv right after it where s is served as FP8 (``fp8_src``);
    and ``[n_sources]`` old source -> its new (value) row."""
    n_src = len(S)
    s_rows = torch.cat([torch.arange(n_src), torch.nonzero(fp8_src).flatten()])
    s_var = torch.cat([fp8_src.long(), torch.full((int(fp8_src.sum()),), 2, dtype=_I64)])
    s_order = torch.argsort(s_rows * 2 + (s_var == 2), stable=True)
    s_rows, s_var = s_rows[s_order], s_var[s_order]
    sources = _table(S, s_rows, s_var, fmt, staging_suffix)
    s_new = torch.empty(n_src, dtype=_I64)
    value_row = s_var != 2
    s_new[s_rows[value_row]] = torch.nonzero(value_row).flatten()
    return sources, s_new


def _new_targets(T: TensorTable, q_t: torch.Tensor, split: _Split, fmt: Fp8Format, staging_suffix: str,
                 ) -> tuple[TensorTable, torch.Tensor]:
    """The new targets: [t] / [t fp8, t scales] / [t:staging, t fp8, t scales] per old target (not
    quantized / trainer / receiver); and ``slot_id`` ``[n_targets, 4]``: (old target, variant) -> new row."""
    n_tgt = len(T)
    trainer, receiver = split.trainer, split.receiver
    t_all = torch.arange(n_tgt)
    parts = [(t_all[~q_t], 1, 0), (t_all[trainer], 1, 1), (t_all[trainer], 2, 2), (t_all[receiver], 0, 3),
             (t_all[receiver], 1, 1), (t_all[receiver], 2, 2)]  # (rows, slot, variant)
    t_rows = torch.cat([p[0] for p in parts])
    t_var = torch.cat([torch.full_like(p[0], p[2]) for p in parts])
    t_order = torch.argsort(t_rows * 3 + torch.cat([torch.full_like(p[0], p[1]) for p in parts]), stable=True)
    t_rows, t_var = t_rows[t_order], t_var[t_order]
    targets = _table(T, t_rows, t_var, fmt, staging_suffix)
    slot_id = torch.full((n_tgt, 4), -1, dtype=_I64)  # old target, variant -> new row
    slot_id[t_rows, t_var] = torch.arange(len(t_rows))
    return targets, slot_id


def _new_ops(ops: OpTable, split: _Split, s_new: torch.Tensor, slot_id: torch.Tensor, sources: TensorTable,
             targets: TensorTable, fmt: Fp8Format) -> OpTable:
    """The ops: value ops retargeted (1 byte per element into trainer-quantized targets), plus one
    scale op per trainer-quantized value op (boxes divided by the block, 4 bytes), grouped by new target."""
    c = ops.columns
    width = c.src_off.shape[1]
    tr_op = split.trainer[c.dst_id]
    dst_variant = torch.where(tr_op, 1, torch.where(split.receiver[c.dst_id], 3, 0))
    v_dst = slot_id[c.dst_id, dst_variant]
    v_item = torch.where(tr_op, 1, ops.itemsize)
    sc = torch.nonzero(tr_op).flatten()
    bl = torch.tensor([1] * (width - 2) + list(fmt.block), dtype=_I64)
    sc_src_off, sc_dst_off = c.src_off[sc] // bl, c.dst_off[sc] // bl
    sc_src_len, sc_dst_len = -(-c.src_len[sc] // bl), -(-c.dst_len[sc] // bl)
    sc_src = s_new[c.src_id[sc]] + 1
    sc_dst = slot_id[c.dst_id[sc], 2]
    src_shape, dst_shape = sources.shapes(width), targets.shapes(width)
    sc_kind = (~(contiguous_runs(sc_src_off, sc_src_len, src_shape[sc_src])
                 & contiguous_runs(sc_dst_off, sc_dst_len, dst_shape[sc_dst]))).long()
    order = torch.argsort(torch.cat([v_dst, sc_dst]), stable=True)

    def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b])[order]

    special = both(c.special, torch.zeros(len(sc), dtype=torch.bool))
    columns = PlanColumns(
        src_id=both(s_new[c.src_id], sc_src), dst_id=both(v_dst, sc_dst), kind=both(c.kind, sc_kind), special=special,
        src_off=both(c.src_off, sc_src_off), src_len=both(c.src_len, sc_src_len), dst_off=both(c.dst_off, sc_dst_off),
        dst_len=both(c.dst_len, sc_dst_len), ndim_ok=both(c.ndim_ok, torch.ones(len(sc), dtype=torch.bool)),
        src_flat=both(c.src_flat, flat_offsets(sc_src_off, src_shape[sc_src])),
        dst_flat=both(c.dst_flat, flat_offsets(sc_dst_off, dst_shape[sc_dst])),
        src_shape=src_shape, dst_shape=dst_shape, dst_numel=targets.numels())
    return OpTable(columns, sources, targets, both(v_item, torch.full((len(sc),), 4, dtype=_I64)),
                   both(ops.transpose, torch.zeros(len(sc), dtype=torch.bool)))


def _quantize_steps(ops: OpTable, split: _Split, fmt: Fp8Format, staging_suffix: str) -> tuple[QuantizeStep, ...]:
    """One step per receiver-quantized target; the reason is the first op (in plan order) whose
    source has one (the plan's only per-target Python loop, over receiver-quantized targets only)."""
    c, S, T = ops.columns, ops.sources, ops.targets
    n_src, n_tgt = len(S), len(T)
    steps = []
    recv = torch.nonzero(split.receiver).flatten().tolist()
    if recv:
        src_bad, mis = split.src_bad, split.mis
        has = src_bad | split.feeds
        first_mis = _first_per(c.src_id[mis], torch.nonzero(mis).flatten(), n_src)
        first_op = _first_per(c.dst_id[has[c.src_id]], torch.nonzero(has[c.src_id]).flatten(), n_tgt)
        why: dict[int, str] = {}
        for t in recv:
            s = int(c.src_id[int(first_op[t])])
            if s not in why:
                if bool(src_bad[s]):
                    i = int(first_mis[s])
                    op = ops[i]
                    why[s] = misaligned(op, S.meta(s).shape, T.meta(int(c.dst_id[i])).shape, fmt) or ""
                else:
                    ref = S.ref(s)
                    why[s] = (f"{ref.name} on rank {ref.rank} also feeds a tensor kept in the model dtype or quantized "
                              "on the receiver")
            ref = T.ref(t)
            steps.append(QuantizeStep(TensorRef(None, ref.name + staging_suffix), ref,
                                      TensorRef(None, ref.name + SCALE_SUFFIX), fmt.block, fmt.ue8m0, why[s]))
    return tuple(steps)


def plan_fp8_columns(plan: Plan, fmt: Fp8Format, staging_suffix: str) -> Plan:
    """:func:`~megarefit.quant.planning.plan_fp8` for a plan whose ops are an
    :class:`~megarefit.plan.table.OpTable`. Validated before returning.

    Raises:
        PlanValidationError: internal inconsistency (a bug).
    """
    ops: OpTable = plan.ops  # type: ignore[assignment]
    c, S, T = ops.columns, ops.sources, ops.targets
    q_t = _quantized_targets(plan)
    mis = q_t[c.dst_id] & _bad_ops(c, S, T, fmt)
    split = _split_targets(c, q_t, mis, len(S), len(T))
    sources, s_new = _new_sources(S, split.fp8_src, fmt, staging_suffix)
    targets, slot_id = _new_targets(T, q_t, split, fmt, staging_suffix)
    out_ops = _new_ops(ops, split, s_new, slot_id, sources, targets, fmt)
    steps = _quantize_steps(ops, split, fmt, staging_suffix)
    out = Plan(plan.direction, plan.dims, plan.layout, plan.dtype, sources, targets, out_ops,  # type: ignore[arg-type]
               digest_of("fp8", plan.digest, list(fmt.block), fmt.ue8m0), steps, plan.transforms)
    validate_plan(out)
    return out


def _first_per(keys: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Per key in ``[0, n)``, the smallest ``index`` with that key (``n_ops``-sized sentinel where none)."""
    big = torch.iinfo(_I64).max
    out = torch.full((n,), big, dtype=_I64)
    return out.scatter_reduce_(0, keys, index, reduce="amin")


__all__ = ["FP8_DTYPE", "plan_fp8_columns"]
