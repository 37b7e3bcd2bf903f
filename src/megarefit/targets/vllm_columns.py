"""Re-target a columnar Megatron -> HF plan onto one vLLM worker's parameters, on columns.

:func:`~megarefit.targets.vllm.plan_megatron_to_vllm`'s join -- every HF op x every
:class:`~megarefit.targets.vllm_layout.VllmPiece` of the same HF tensor, intersected --
as whole-column operations::

    pieces   p: (param j, HF row t, hf_box, param_box)        ops of HF row t: [start_t, start_t + n_t)
    pairs    (p, op) for op in ops of t_p                      (repeat_interleave over n_t)
    part     = op.dst_box  n  piece.hf_box                     (empty: dropped)
    source   = op.src_box shifted by part - op.dst_box         (transposed: last two dims swapped)
    placed   = piece.param_box shifted by part - piece.hf_box  (leading expert-slot dims kept)

Boxes are right-aligned in ``W`` padded dims (offset 0, length 1 in front), so an expert
slot dim the HF box lacks needs no special case. Consecutive contiguous pairs that
continue each other in both tensors are merged (``merge_ops``'s rule, applied exactly to
the few runs that qualify). Pairs keep the per-object order: parameter, piece, HF op.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from megarefit.errors import PlanValidationError
from megarefit.layout import Box
from megarefit.plan import Plan, QuantizeStep, TensorMeta, TensorRef, ValueStep, validate_plan
from megarefit.plan.columns import PlanColumns, contiguous_runs, flat_offsets
from megarefit.plan.table import OpTable, TensorTable
from megarefit.targets.vllm_layout import VllmParam

_I64 = torch.int64


class ListTable(Mapping[TensorRef, TensorMeta]):
    """A small tensor table held as lists (vLLM parameters: ~10^3 per worker), with the
    row interface :class:`~megarefit.plan.table.OpTable` reads."""

    def __init__(self, refs: Sequence[TensorRef], metas: Sequence[TensorMeta]):
        self.refs, self.metas = list(refs), list(metas)
        self._dict = dict(zip(self.refs, self.metas))

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, ref: object) -> TensorMeta:
        return self._dict[ref]  # type: ignore[index]

    def __iter__(self) -> Iterator[TensorRef]:
        return iter(self._dict)

    def ref(self, i: int) -> TensorRef:
        return self.refs[i]

    def meta(self, i: int) -> TensorMeta:
        return self.metas[i]

    def shapes(self, width: int) -> torch.Tensor:
        return torch.tensor([(1,) * (width - len(m.shape)) + tuple(m.shape) for m in self.metas] or [[1] * width],
                            dtype=_I64).reshape(-1, width)[:len(self.metas)]

    def ndims(self) -> torch.Tensor:
        return torch.tensor([len(m.shape) for m in self.metas], dtype=_I64)

    def numels(self) -> torch.Tensor:
        return torch.tensor([m.numel for m in self.metas], dtype=_I64)


def _pad(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    return torch.cat([torch.full((t.shape[0], width - t.shape[1]), fill, dtype=_I64), t], 1) if t.shape[1] < width \
        else t


class _Pieces(NamedTuple):
    """Every vLLM parameter piece as columns (one row per piece, boxes right-aligned in ``width`` dims)."""

    param: torch.Tensor  # parameter index j
    row: torch.Tensor  # the HF plan's target row t of its HF tensor
    hf_off: torch.Tensor  # hf_box offsets
    hf_len: torch.Tensor  # hf_box lengths
    param_off: torch.Tensor  # param_box offsets


def _parameters(typed: Mapping[str, tuple[VllmParam, str | None]], produced: set[str], dtype: str,
                hf_targets: TensorTable, width: int) -> tuple[list[TensorRef], list[TensorMeta], list[int], _Pieces]:
    """Per parameter its ref, meta and filled rows (pieces' first param-box lengths), and every
    piece of a parameter not in ``produced``, in parameter then piece order.

    Raises:
        PlanValidationError: a piece's HF tensor is not a target of the HF plan.
    """
    row_of = hf_targets.index if hasattr(hf_targets, "index") else {r: i for i, r in enumerate(hf_targets)}
    refs, metas, fills = [], [], []  # per parameter
    p_param, p_row, p_hfo, p_hfl, p_po = [], [], [], [], []
    for j, (name, (param, pdtype)) in enumerate(typed.items()):
        first = row_of.get(TensorRef(None, param.pieces[0].hf_name)) if param.pieces else None
        meta = hf_targets.meta(first) if first is not None else None
        refs.append(TensorRef(None, name))
        metas.append(TensorMeta(param.shape, pdtype or (meta.dtype if meta is not None else dtype),
                                storage_shape=param.storage))
        fills.append(sum(p.param_box.lengths[0] for p in param.pieces))
        if name in produced:
            continue
        for piece in param.pieces:
            row = row_of.get(TensorRef(None, piece.hf_name))
            if row is None:
                raise PlanValidationError(f"vLLM parameter {name}: its piece {piece.hf_box} of HF tensor "
                                          f"{piece.hf_name!r} is not a target of the HF plan "
                                          f"({len(hf_targets)} targets, e.g. {hf_targets.ref(0)})")
            p_param.append(j)
            p_row.append(row)
            lead = width - len(piece.hf_box.offsets)
            p_hfo.append((0,) * lead + piece.hf_box.offsets)
            p_hfl.append((1,) * lead + piece.hf_box.lengths)
            lead = width - len(piece.param_box.offsets)
            p_po.append((0,) * lead + piece.param_box.offsets)

    def tens(rows: list, cols: int) -> torch.Tensor:
        return torch.tensor(rows, dtype=_I64).reshape(-1, cols)

    pieces = _Pieces(torch.tensor(p_param, dtype=_I64), torch.tensor(p_row, dtype=_I64), tens(p_hfo, width),
                     tens(p_hfl, width), tens(p_po, width))
    return refs, metas, fills, pieces


def _pairs(c: PlanColumns, n_t: int, pieces: _Pieces, width: int) -> tuple[torch.Tensor, ...]:
    """Every (piece, HF op of its HF tensor) pair whose part (``op.dst_box`` n ``piece.hf_box``)
    is not empty, in piece then op order: ``(pair_piece, op, lo, hi, d_off, s_off, d_len)``, ``[lo, hi)``
    the part in HF coordinates, ``d_off`` / ``s_off`` the op's padded dst / src offsets, ``d_len`` its
    padded dst lengths."""
    n_pieces = len(pieces.param)
    hfo, hfl = pieces.hf_off, pieces.hf_len
    count = torch.bincount(c.dst_id, minlength=n_t)
    start = torch.cumsum(count, 0) - count
    per = count[pieces.row] if n_pieces else torch.zeros(0, dtype=_I64)
    pair_piece = torch.repeat_interleave(torch.arange(n_pieces), per)
    first = torch.cumsum(per, 0) - per
    op = start[pieces.row][pair_piece] + torch.arange(len(pair_piece)) - first[pair_piece]
    d_off, d_len = _pad(c.dst_off[op], width, 0), _pad(c.dst_len[op], width, 1)
    s_off = _pad(c.src_off[op], width, 0)
    lo = torch.maximum(d_off, hfo[pair_piece])
    hi = torch.minimum(d_off + d_len, hfo[pair_piece] + hfl[pair_piece])
    keep = (hi > lo).all(1)
    return pair_piece[keep], op[keep], lo[keep], hi[keep], d_off[keep], s_off[keep], d_len[keep]


def _aligned(shift: torch.Tensor, part_len: torch.Tensor, d_len: torch.Tensor, s_len: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``shift`` / ``part_len`` (per dim of the op's dst box) moved onto the source box's dims: the
    dims longer than 1 correspond in order on both sides (a validated op's boxes have the same
    lengths once 1-dims are dropped; gpt-oss's interleave puts a 1-dim between them in the
    target only), 1-dims take shift 0 and length 1."""
    order_d = torch.argsort((d_len > 1).long(), dim=1, stable=True)
    order_s = torch.argsort((s_len > 1).long(), dim=1, stable=True)
    return (torch.zeros_like(shift).scatter_(1, order_s, shift.gather(1, order_d)),
            torch.ones_like(part_len).scatter_(1, order_s, part_len.gather(1, order_d)))


def _source_boxes(s_off: torch.Tensor, shift: torch.Tensor, part_len: torch.Tensor,
                  transpose: torch.Tensor, d_len: torch.Tensor, s_len: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, lengths) of each part in its source: the op's source box shifted by ``shift``
    (the part's offset inside the op's dst box, dims matched by :func:`_aligned` where the two
    boxes differ in 1-dims); for transposed ops the last two dims swapped."""
    odd = (d_len != s_len).any(1) & ~transpose
    if bool(odd.any()):
        shift, part_len = shift.clone(), part_len.clone()
        shift[odd], part_len[odd] = _aligned(shift[odd], part_len[odd], d_len[odd], s_len[odd])
    src_off = s_off + shift
    src_len = part_len.clone()
    if bool(transpose.any()):  # last two dims swapped; the source's leading dims stay length 1
        t = transpose
        src_off[t, -2] = s_off[t, -2] + shift[t, -1]
        src_off[t, -1] = s_off[t, -1] + shift[t, -2]
        src_len[t, -2], src_len[t, -1] = part_len[t, -1], part_len[t, -2]
        lead = torch.zeros_like(src_len[t])
        lead[:, :-2] = 1
        src_len[t] = torch.where(lead.bool(), 1, src_len[t])
        src_off[t, :-2] = s_off[t, :-2]
    return src_off, src_len


def _fill_metas(refs: list[TensorRef], metas: list[TensorMeta], fills: list[int], produced: set[str],
                dst_id: torch.Tensor, dst_len: torch.Tensor) -> ListTable:
    """The target table, each parameter the parts do not cover (vocab padding past
    ``vocab_size``) declaring its rows past ``fills`` as zero fill (``metas`` updated in place)."""
    written = torch.zeros(len(refs), dtype=_I64).index_add_(0, dst_id, dst_len.prod(1))
    for j, (m, w) in enumerate(zip(metas, written.tolist())):
        if refs[j].name not in produced and w < m.numel:
            metas[j] = TensorMeta(m.shape, m.dtype, (Box.rows(m.shape, fills[j], m.shape[0] - fills[j]),),
                                  m.storage_shape)
    return ListTable(refs, metas)


def _merged_columns(columns: list[torch.Tensor], ops: OpTable, targets: ListTable, src_shape: torch.Tensor,
                    width: int) -> tuple[PlanColumns, torch.Tensor, torch.Tensor]:
    """(plan columns, itemsize, transpose) of the pairs' ``columns`` (src_id, dst_id, kind, src_off,
    src_len, dst_off, dst_len, src_flat, dst_flat, item, transpose) after merging runs of contiguous
    ops that continue each other (few; ``merge_ops`` decides)."""
    src_id, dst_id, kind, src_off, src_len, dst_off, dst_len, src_flat, dst_flat, item, transpose = columns
    cand = (kind[:-1] == 0) & (kind[1:] == 0) & (src_id[:-1] == src_id[1:]) & (dst_id[:-1] == dst_id[1:]) \
        & (src_flat[:-1] + src_len[:-1].prod(1) == src_flat[1:]) \
        & (dst_flat[:-1] + dst_len[:-1].prod(1) == dst_flat[1:])
    if bool(cand.any()):
        columns = _merge(columns, cand, ops, targets, width)
    src_id, dst_id, kind, src_off, src_len, dst_off, dst_len, src_flat, dst_flat, item, transpose = columns
    cols = PlanColumns(src_id=src_id, dst_id=dst_id, kind=kind, special=transpose.clone(), src_off=src_off,
                       src_len=src_len, dst_off=dst_off, dst_len=dst_len, ndim_ok=_ndim_ok(ops, targets, src_id,
                                                                                           dst_id, src_len, dst_len),
                       src_flat=src_flat, dst_flat=dst_flat, src_shape=src_shape, dst_shape=targets.shapes(width),
                       dst_numel=targets.numels())
    return cols, item, transpose


def retarget(hf_plan: Plan, typed: Mapping[str, tuple[VllmParam, str | None]], produced: set[str], dtype: str,
             steps: Sequence[QuantizeStep], digest: str, transforms: Sequence[ValueStep] = ()) -> Plan:
    """The vLLM worker's plan from a columnar ``hf_plan`` (see the module docstring);
    ``typed``: parameter name -> (parameter, dtype override); ``produced``: names a quantize
    step writes (declared, no ops). Validated before returning.

    Raises:
        PlanValidationError: internal inconsistency (a bug).
    """
    ops: OpTable = hf_plan.ops  # type: ignore[assignment]
    c, hf_targets = ops.columns, ops.targets
    width = max([c.src_off.shape[1]] + [len(p.shape) for p, _ in typed.values()])
    refs, metas, fills, pieces = _parameters(typed, produced, dtype, hf_targets, width)

    # ---- pairs (piece, HF op of its HF tensor), in piece order then op order
    pair_piece, op, lo, hi, d_off, s_off, d_len = _pairs(c, len(hf_targets), pieces, width)
    part_len = hi - lo
    transpose = ops.transpose[op]
    src_off, src_len = _source_boxes(s_off, lo - d_off, part_len, transpose, d_len, _pad(c.src_len[op], width, 1))
    dst_off = pieces.param_off[pair_piece] + (lo - pieces.hf_off[pair_piece])
    dst_len = part_len
    dst_id = pieces.param[pair_piece]
    src_id = c.src_id[op]

    src_shape, dst_shape = ops.sources.shapes(width), ListTable(refs, metas).shapes(width)
    s_run = contiguous_runs(src_off, src_len, src_shape[src_id])
    d_run = contiguous_runs(dst_off, dst_len, dst_shape[dst_id])
    kind = (~(s_run & d_run & ~transpose)).long()
    item = ops.itemsize[op]
    src_flat, dst_flat = flat_offsets(src_off, src_shape[src_id]), flat_offsets(dst_off, dst_shape[dst_id])

    # ---- zero fill (vocab padding past vocab_size) where the parts do not cover a parameter
    targets_table = _fill_metas(refs, metas, fills, produced, dst_id, dst_len)

    # ---- merge runs of contiguous ops that continue each other (few; merge_ops decides)
    columns = [src_id, dst_id, kind, src_off, src_len, dst_off, dst_len, src_flat, dst_flat, item, transpose]
    cols, item, transpose = _merged_columns(columns, ops, targets_table, src_shape, width)
    out = OpTable(cols, ops.sources, targets_table, item, transpose)  # type: ignore[arg-type]
    plan = Plan("megatron_to_vllm", hf_plan.dims, hf_plan.layout, dtype, ops.sources, targets_table,
                out, digest, tuple(steps), tuple(transforms))  # type: ignore[arg-type]
    validate_plan(plan)
    return plan


def _ndim_ok(ops: OpTable, targets: ListTable, src_id: torch.Tensor, dst_id: torch.Tensor, src_len: torch.Tensor,
             dst_len: torch.Tensor) -> torch.Tensor:
    """Boxes are cut to their tensors' ranks when built (``OpTable``); only the padded part
    beyond a tensor's rank must be length 1."""
    width = src_len.shape[1]
    pos = torch.arange(width)[None, :]
    s_pad = pos < (width - ops.sources.ndims()[src_id])[:, None]
    d_pad = pos < (width - targets.ndims()[dst_id])[:, None]
    return ((src_len == 1) | ~s_pad).all(1) & ((dst_len == 1) | ~d_pad).all(1)


def _run_box(start: int, n: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Elements ``[start, start + n)`` of a row-major ``shape`` as one box (offsets, lengths):
    leading length-1 dims, one partial dim ``d``, full dims after it; ``None`` if the run is
    no such box."""
    inner = 1
    for d in range(len(shape) - 1, -1, -1):  # d: the partial dim, innermost first
        size = shape[d]
        if start % inner == 0 and n % inner == 0:
            o, length = (start // inner) % size, n // inner
            if o + length <= size:
                offsets, rest = [], start // inner
                for k in range(d, -1, -1):
                    offsets.append(rest % shape[k])
                    rest //= shape[k]
                return (tuple(reversed(offsets)) + (0,) * (len(shape) - d - 1),
                        (1,) * d + (length,) + tuple(shape[d + 1:]))
        inner *= size
    return None


def _merge(columns: list[torch.Tensor], cand: torch.Tensor, ops: OpTable, targets: ListTable,
           width: int) -> list[torch.Tensor]:
    """Merge each run of candidate pairs (contiguous, same tensors, continuing each other in
    both) as ``megarefit.plan.merge_ops`` does: the merged op grows while the joined
    flat runs stay boxes in both tensors (for two contiguous boxes that continue each other,
    ``joined`` exists and is contiguous exactly then)."""
    src_id, dst_id, _, src_off, src_len, dst_off, dst_len, src_flat, dst_flat, _, _ = columns
    n = len(src_id)
    in_run = torch.zeros(n, dtype=torch.bool)
    in_run[:-1] |= cand
    in_run[1:] |= cand
    idx = torch.nonzero(in_run).flatten().tolist()
    cand_l = cand.tolist()
    sid, did = src_id.tolist(), dst_id.tolist()
    sflat, dflat = src_flat.tolist(), dst_flat.tolist()
    numel = src_len.prod(1).tolist()
    s_shapes = [g.meta.shape for g in ops.sources.groups]
    s_group = ops.sources.group.tolist() if hasattr(ops.sources, "group") else None
    keep = [True] * n
    rewrite: dict[int, tuple[tuple, tuple]] = {}  # head row -> (src box, dst box) of its merged run
    head, grown = -1, 0
    for i in idx:
        if head >= 0 and cand_l[i - 1] and i - 1 >= head:
            s_shape = s_shapes[s_group[sid[i]]] if s_group is not None else ops.sources.meta(sid[i]).shape
            d_shape = targets.meta(did[i]).shape
            total = grown + numel[i]
            sb, db = _run_box(sflat[head], total, s_shape), _run_box(dflat[head], total, d_shape)
            if sb is not None and db is not None:
                grown = total
                keep[i] = False
                rewrite[head] = (sb, db)
                continue
        head, grown = i, numel[i]
    if rewrite:
        rows = torch.tensor(list(rewrite), dtype=_I64)
        for col, part, fill in ((src_off, 0, 0), (src_len, 1, 1)):
            col[rows] = torch.tensor([(fill,) * (width - len(b[part])) + b[part] for b, _ in rewrite.values()],
                                     dtype=_I64)
        for col, part, fill in ((dst_off, 0, 0), (dst_len, 1, 1)):
            col[rows] = torch.tensor([(fill,) * (width - len(b[part])) + b[part] for _, b in rewrite.values()],
                                     dtype=_I64)
    mask = torch.tensor(keep, dtype=torch.bool)
    return [col[mask] for col in columns]


__all__ = ["ListTable", "retarget"]
