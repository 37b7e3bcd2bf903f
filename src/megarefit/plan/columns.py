"""A plan's ops as int64 columns, and the exact-cover checks run on whole columns.

:class:`PlanColumns` holds one row per op (tensor ids into ``sources`` / ``targets``
order, boxes left-padded to ``D`` dims with offset 0 / length 1, flat offsets, kind),
and one row per tensor (padded shapes). :func:`vectorized_checks` proves, with a few
torch ops over all rows at once, what :func:`~megarefit.plan.validate_plan` checks op by
op: bounds, equal lengths, kind and offsets consistent with the boxes, one side a single
run; per target, covered volume == element count; disjoint boxes for the common shapes::

    box partial in 0 dims: the whole tensor        (alone, or the volume check fails)
    box partial in 1 dim d: a slab along d         slabs of one target along one dim:
        [ rows a..b, every column ]                 sorted by offset, each starts where
        [ every row, columns c..d ]                 the previous ends or later; slabs
                                                    along two different dims always overlap
    partial in 2+ dims, all of one target's        a tiling: every offset a multiple of the
        boxes the same lengths (fused experts,      lengths, no grid cell twice (gpt-oss's
        FusedMoE slots)                              gate_up [E, h, f, 2]: (1, h, f/etp, 1) tiles)
    other partial-in-2+-dims targets, zero-fill boxes: left to the per-item checks

Box lengths agree when they are equal with every length-1 dim dropped (an expert slot in
front, an interleave behind); a transposed op's boxes are matrices (exactly two adjacent
dims longer than 1 on each side, else left to the per-op checks) with rows and columns
swapped.

It answers "proved" or the ops / targets the per-item checks must look at (every
failure is reported by those, with names). Measured: DeepSeek-V3 tp8 ep64, 360k ops
(docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megarefit.plan.ops import CopyOp, TensorMeta, TensorRef

_KIND = {"contiguous": 0, "scratch": 1}
PLAN_THREADS = 4  # intra-op threads for column work; more only cost (measured below)


@contextlib.contextmanager
def plan_threads(limit: int = PLAN_THREADS) -> Iterator[None]:
    """At most ``limit`` torch intra-op threads inside the block (restored after).

    Column work is ~10^3-10^6 int64s per op, where a wide thread pool costs more than it
    gives: a Qwen3-30B-A3B (8 layers) receiver plan took 0.29 s with torch's default 32
    threads on an H200 host and 0.054 s with 4 (0.097 s with 1)."""
    before = torch.get_num_threads()
    if before > limit:
        torch.set_num_threads(limit)
    try:
        yield
    finally:
        if before > limit:
            torch.set_num_threads(before)


def _pad(t: tuple[int, ...], d: int, fill: int) -> tuple[int, ...]:
    return (fill,) * (d - len(t)) + tuple(t)


@dataclass(frozen=True)
class PlanColumns:
    """Columns of a plan (all int64 torch tensors on the CPU; ``D`` = widest rank)."""

    src_id: torch.Tensor  # [ops]
    dst_id: torch.Tensor  # [ops]
    kind: torch.Tensor  # [ops] 0 contiguous, 1 scratch
    special: torch.Tensor  # [ops] bool: transposed (lengths checked as matrices)
    src_off: torch.Tensor  # [ops, D]
    src_len: torch.Tensor  # [ops, D]
    dst_off: torch.Tensor  # [ops, D]
    dst_len: torch.Tensor  # [ops, D]
    ndim_ok: torch.Tensor  # [ops] bool: box ranks equal their tensors' ranks
    src_flat: torch.Tensor  # [ops] recorded flat element offsets
    dst_flat: torch.Tensor  # [ops]
    src_shape: torch.Tensor  # [sources, D]
    dst_shape: torch.Tensor  # [targets, D]
    dst_numel: torch.Tensor  # [targets]

    @classmethod
    def from_plan(cls, plan: Any) -> PlanColumns:
        """Columns of a plan (anything with ``sources``, ``targets`` and ``ops``): :meth:`from_ops`."""
        return cls.from_ops(plan.sources, plan.targets, plan.ops)

    @classmethod
    def from_ops(cls, sources: Mapping[TensorRef, TensorMeta], targets: Mapping[TensorRef, TensorMeta],
                 ops: Sequence[CopyOp]) -> PlanColumns:
        """Columns of a plan's ``ops`` over its ``sources`` / ``targets`` (ids in their order).
        Raises ``KeyError`` for an op naming an undeclared tensor."""
        sid = {ref: i for i, ref in enumerate(sources)}
        tid = {ref: i for i, ref in enumerate(targets)}
        width = max([len(m.shape) for m in sources.values()] + [len(m.shape) for m in targets.values()] + [1])
        s_meta, t_meta = list(sources.values()), list(targets.values())
        s_ndim, t_ndim = [len(m.shape) for m in s_meta], [len(m.shape) for m in t_meta]
        rows, boxes = array("q"), array("q")  # flat int64 buffers: no Python tuple per element
        kinds = _KIND
        for op in ops:
            s, t = sid[op.src], tid[op.dst]
            so, sl, do, dl = op.src_box.offsets, op.src_box.lengths, op.dst_box.offsets, op.dst_box.lengths
            ok = len(so) == s_ndim[s] and len(do) == t_ndim[t]
            if len(so) != width:
                so, sl = _pad(so, width, 0), _pad(sl, width, 1)
            if len(do) != width:
                do, dl = _pad(do, width, 0), _pad(dl, width, 1)
            special = op.transpose
            rows.extend((s, t, kinds[op.kind], special, ok, op.src_offset, op.dst_offset))
            boxes.extend(so)
            boxes.extend(sl)
            boxes.extend(do)
            boxes.extend(dl)
        r = torch.frombuffer(rows, dtype=torch.int64).clone().reshape(-1, 7) if rows else torch.zeros(0, 7,
                                                                                                       dtype=torch.int64)
        b = (torch.frombuffer(boxes, dtype=torch.int64).clone().reshape(-1, 4 * width) if boxes
             else torch.zeros(0, 4 * width, dtype=torch.int64))
        box = [b[:, k * width:(k + 1) * width] for k in range(4)]
        return cls(src_id=r[:, 0], dst_id=r[:, 1], kind=r[:, 2], special=r[:, 3].bool(), src_off=box[0],
                   src_len=box[1], dst_off=box[2], dst_len=box[3], ndim_ok=r[:, 4].bool(), src_flat=r[:, 5],
                   dst_flat=r[:, 6],
                   src_shape=torch.tensor([_pad(m.shape, width, 1) for m in s_meta], dtype=torch.int64).reshape(-1, width),
                   dst_shape=torch.tensor([_pad(m.shape, width, 1) for m in t_meta], dtype=torch.int64).reshape(-1, width),
                   dst_numel=torch.tensor([m.numel for m in t_meta], dtype=torch.int64))


def contiguous_runs(off: torch.Tensor, length: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """Per row: the box is one run of the row-major tensor (after the first dim with
    length > 1, every dim is full) -- :meth:`Box.is_contiguous_in` on whole columns."""
    started = torch.cumsum((length > 1).long(), 1) - (length > 1).long() > 0  # a longer dim came before
    full = (off == 0) & (length == shape)
    return (~started | full).all(1)


def flat_offsets(off: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    strides = torch.flip(torch.cumprod(torch.flip(shape, [1]), 1), [1])
    strides = torch.cat([strides[:, 1:], torch.ones_like(strides[:, :1])], 1)
    return (off * strides).sum(1)


def _compact(length: torch.Tensor) -> torch.Tensor:
    """Each row's lengths other than 1, in order, right-aligned (1s in front)."""
    order = torch.argsort((length > 1).long(), dim=1, stable=True)
    return length.gather(1, order)


def _matrix(length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``(rows, cols, ok)``: a box as a matrix, ok where exactly two adjacent dims are longer than 1."""
    long_ = length > 1
    width = length.shape[1]
    idx = torch.arange(width).expand_as(length)
    last = torch.where(long_, idx, -1).max(1).values
    first = torch.where(long_, idx, width).min(1).values
    ok = (long_.sum(1) == 2) & (last - first == 1)
    cols = length.gather(1, last.clamp(min=0)[:, None]).squeeze(1)
    return length.prod(1) // cols.clamp(min=1), cols, ok


def _lengths_agree(cols: PlanColumns) -> torch.Tensor:
    """Per op: box lengths agree (module docstring), transposed ops as swapped matrices; the
    common case (equal padded lengths, not transposed) settled first, the rest on its rows."""
    out = (cols.src_len == cols.dst_len).all(1) & ~cols.special
    rest = torch.nonzero(~out).flatten()
    if not len(rest):
        return out
    s_len, d_len, special = cols.src_len[rest], cols.dst_len[rest], cols.special[rest]
    plain = (_compact(s_len) == _compact(d_len)).all(1)
    s_rows, s_cols, s_ok = _matrix(s_len)
    d_rows, d_cols, d_ok = _matrix(d_len)
    swapped = s_ok & d_ok & (s_rows == d_cols) & (s_cols == d_rows)
    out[rest] = torch.where(special, swapped, plain)
    return out


def _tiled(cols: PlanColumns, d_shape: torch.Tensor, multi: torch.Tensor, n_targets: int) -> torch.Tensor:
    """``[targets]`` bool: every op box of the target is partial in 2+ dims (``multi``), all of
    them have the same lengths, sit on the grid of those lengths, and no two share a cell
    (computed on the ops of targets with such boxes only)."""
    cand = torch.zeros(n_targets, dtype=torch.bool)
    cand[cols.dst_id[multi]] = True
    sel = torch.nonzero(cand[cols.dst_id]).flatten()
    ids, multi, d_shape = cols.dst_id[sel], multi[sel], d_shape[sel]
    d_len, d_off = cols.dst_len[sel], cols.dst_off[sel]
    first = torch.full((n_targets,), len(ids), dtype=torch.int64).scatter_reduce_(0, ids, torch.arange(len(ids)),
                                                                                   "amin")
    same = (d_len == d_len[first.clamp(max=max(len(ids) - 1, 0))[ids]]).all(1)
    length = d_len.clamp(min=1)  # an empty box is flagged by the bounds check
    aligned = ((d_off % length) == 0).all(1) & ((d_shape % length) == 0).all(1)
    op_ok = same & aligned & multi
    bad = torch.zeros(n_targets, dtype=torch.bool)
    bad[ids[~op_ok]] = True
    cell = flat_offsets(d_off // length, d_shape // length)
    key = ids * (int(cell.max()) + 1 if len(cell) else 1) + cell
    srt, order = torch.sort(key)
    dup = srt[1:] == srt[:-1]
    bad[ids[order[1:][dup]]] = True
    return cand & ~bad


def vectorized_checks(cols: PlanColumns) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ops, targets)`` that the vectorized checks could not prove (indices into
    ``plan.ops`` / ``plan.targets``); both empty means every op and every target whose
    boxes are whole tensors or slabs is proved (targets with zero-fill boxes or quantize
    steps are the caller's)."""
    s_shape, d_shape = cols.src_shape[cols.src_id], cols.dst_shape[cols.dst_id]
    inside = ((cols.src_off >= 0) & (cols.src_len > 0) & (cols.src_off + cols.src_len <= s_shape)).all(1) \
        & ((cols.dst_off >= 0) & (cols.dst_len > 0) & (cols.dst_off + cols.dst_len <= d_shape)).all(1)
    s_run, d_run = contiguous_runs(cols.src_off, cols.src_len, s_shape), contiguous_runs(cols.dst_off, cols.dst_len, d_shape)
    kind_ok = torch.where(s_run & d_run & ~cols.special, cols.kind == 0, cols.kind == 1) & (s_run | d_run)
    flat_ok = (cols.src_flat == flat_offsets(cols.src_off, s_shape)) & (cols.dst_flat == flat_offsets(cols.dst_off, d_shape))
    good = cols.ndim_ok & inside & kind_ok & flat_ok & _lengths_agree(cols)
    bad_ops = torch.nonzero(~good).flatten()
    # per target: covered volume, and disjoint slabs
    n_targets = cols.dst_shape.shape[0]
    numel = cols.dst_len.prod(1)
    covered = torch.zeros(n_targets, dtype=torch.int64).index_add_(0, cols.dst_id, numel)
    partial = (cols.dst_off != 0) | (cols.dst_len != d_shape)
    n_partial = partial.sum(1)
    dim = torch.where(n_partial == 1, partial.long().argmax(1), torch.full_like(n_partial, -1))
    odd = torch.zeros(n_targets, dtype=torch.bool)
    odd[cols.dst_id[n_partial > 1]] = True
    odd &= ~_tiled(cols, d_shape, n_partial > 1, n_targets)
    odd[cols.dst_id[~good]] = True  # left to the per-target sweep
    whole = n_partial == 0
    # a whole-tensor box shares its target with nothing (else the volume exceeds the numel)
    slab = n_partial == 1
    ids, dims_ = cols.dst_id[slab], dim[slab]
    start = cols.dst_off[slab].gather(1, dims_[:, None]).squeeze(1)
    stop = start + cols.dst_len[slab].gather(1, dims_[:, None]).squeeze(1)
    order = torch.argsort(ids * (start.max() + 1 if len(start) else 1) + start, stable=True)
    ids, dims_, start, stop = ids[order], dims_[order], start[order], stop[order]
    same = ids[1:] == ids[:-1]
    clash = same & ((dims_[1:] != dims_[:-1]) | (start[1:] < stop[:-1]))
    odd[ids[1:][clash]] = True
    odd |= covered != cols.dst_numel
    del whole
    return bad_ops, torch.nonzero(odd).flatten()


__all__ = ["PLAN_THREADS", "PlanColumns", "plan_threads", "vectorized_checks"]
