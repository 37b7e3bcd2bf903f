"""The export planner as it was before it moved to columns: one Python object per
source tensor and per op, straight from ``source_tensors`` and ``pieces``. Kept as an
independent implementation for tests/test_plan_columns.py to compare the columnar
planner (:mod:`megarefit.planner.megatron_to_hf`) against, op for op."""

from __future__ import annotations

from collections import defaultdict

from megarefit.layout.dims import ModelDims
from megarefit.layout import Box, RankCoord, SourceLayout
from megarefit.plan import CopyOp, Plan, TensorMeta, TensorRef, digest_of, itemsize, make_op, merge_ops, validate_plan
from megarefit.layout.geometry import (
    fused_boxes,
    fused_shapes,
    grouped_pieces,
    hf_shapes,
    piece_boxes,
    pieces,
    source_tensors,
    view_shape,
)
from megarefit.specs.table import Role
from megarefit.targets.vllm_layout import VllmPiece


def reference_megatron_to_hf(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                             experts: frozenset[int] | None = None) -> Plan:
    """``plan_megatron_to_hf`` as it was before columns: one object per source tensor and per
    op, straight from ``source_tensors`` and ``pieces``; targets in first-seen order (the
    same rules, so the same sources, targets and ops as a set)."""
    tensors = source_tensors(dims, layout)
    sources = {TensorRef(r, n): TensorMeta(t.shape, t.spec.dtype or dtype)
               for r, ts in tensors.items() for n, t in ts.items()}
    targets: dict[TensorRef, TensorMeta] = {}
    by_target: dict[TensorRef, list[CopyOp]] = defaultdict(list)
    replicated_count: dict[int, int] = defaultdict(int)
    for rank, ts in tensors.items():
        for name, t in ts.items():
            if t.spec.duplicate:
                continue
            if not t.spec.role.is_expert and rank.ep != layout.dense_ep(rank.tp):
                continue  # non-expert tensors are replicated over ep: read one existing copy
            if experts is not None and t.expert is not None and t.expert not in experts:
                continue  # an expert this receiver does not own
            if t.spec.role.is_grouped:
                if layout.etp == 1 and rank.tp != layout.expert_tps(rank.ep)[0]:
                    continue  # whole experts on every TP rank: read them from one
                view = view_shape(t.spec, dims, layout)
                sources[TensorRef(rank, name)] = TensorMeta(view, t.spec.dtype or dtype, storage_shape=t.shape)
                item = itemsize(t.spec.dtype or dtype)
                hf_shape = hf_shapes(t.spec, dims, layout)[0]
                per_ep = dims.num_experts // layout.ep
                for hf_name, sbox, dbox in grouped_pieces(t.spec, dims, layout, rank.tp, rank.ep, t.layer):
                    if experts is not None and rank.ep * per_ep + sbox.offsets[0] not in experts:
                        continue  # an expert this receiver does not own
                    dst = TensorRef(None, hf_name)
                    targets.setdefault(dst, TensorMeta(hf_shape, t.spec.dtype or dtype))
                    by_target[dst].append(make_op(TensorRef(rank, name), view, sbox, dst, hf_shape, dbox, item,
                                                  transpose=True, src_view=True))
                continue
            if t.spec.role.is_fused:
                _fused_ops(dims, layout, dtype, experts, rank, name, t, targets, by_target)
                continue
            names = t.spec.hf_names(t.layer, t.expert)
            shapes = hf_shapes(t.spec, dims, layout)
            tdtype = t.spec.dtype or dtype
            item = itemsize(tdtype)
            for hf_name, shape in zip(names, shapes):
                targets.setdefault(TensorRef(None, hf_name), TensorMeta(shape, tdtype))
            reader = rank
            if t.spec.role is Role.REPLICATED:
                if rank.tp != 0:
                    continue  # one replica is enough; chosen below from the tp=0 visit
                k = replicated_count[rank.pp] % layout.tp
                replicated_count[rank.pp] += 1
                reader = RankCoord(k, rank.pp, layout.dense_ep(k))
            elif t.spec.role.is_expert and layout.etp == 1 and layout.tp > 1:
                tps = layout.expert_tps(rank.ep)
                if rank.tp != tps[0]:
                    continue  # whole experts on every TP rank: spread experts over the TP ranks that exist
                reader = RankCoord(tps[t.expert % len(tps)], rank.pp, rank.ep)  # same name on every TP rank
            shape_of = dict(zip(names, shapes))
            for p in pieces(t.spec, names, dims, layout, reader.tp):
                sbox, dbox = piece_boxes(p, t.shape, shape_of[p.hf_name])
                dst = TensorRef(None, p.hf_name)
                by_target[dst].append(make_op(TensorRef(reader, name), t.shape, sbox, dst, shape_of[p.hf_name], dbox,
                                              item))
    # targets in first-seen order: embedding, layers in order, final norm, head
    ops = [op for ref in targets for op in merge_ops(by_target[ref], sources, targets)]
    plan = Plan("megatron_to_hf", dims, layout, dtype, sources, targets, tuple(ops),
                digest_of("megatron_to_hf", dims.to_dict(), layout.to_dict(), dtype,
                          None if experts is None else sorted(experts)))
    validate_plan(plan)
    return plan




def _fused_ops(dims, layout, dtype, experts, rank, name, t, targets, by_target) -> None:
    """Ops of one expert's tensor of a fused role (gpt-oss): its boxes from ``fused_boxes`` moved to
    the expert's slot among the owned experts."""
    if layout.etp == 1 and layout.tp > 1:
        tps = layout.expert_tps(rank.ep)
        if rank.tp != tps[0]:
            return
        rank = RankCoord(tps[t.expert % len(tps)], rank.pp, rank.ep)
    elif t.spec.role is Role.EXPERT_REPLICATED_FUSED and rank.tp != layout.expert_tps(rank.ep)[0]:
        return  # whole on every expert-TP rank: read from the first
    owned = sorted(range(dims.num_experts) if experts is None else (e for e in experts if e < dims.num_experts))
    view, stored = fused_shapes(t.spec, dims, layout, len(owned))
    tdtype = t.spec.dtype or dtype
    dst = TensorRef(None, t.spec.hf_names(t.layer)[0])
    targets.setdefault(dst, TensorMeta(view, tdtype, storage_shape=None if view == stored else stored))
    for sbox, dbox, tr in fused_boxes(t.spec, dims, layout, rank.tp):
        at = Box((owned.index(t.expert),) + dbox.offsets[1:], dbox.lengths)
        by_target[dst].append(make_op(TensorRef(rank, name), t.shape, sbox, dst, view, at, itemsize(tdtype),
                                      transpose=tr, dst_view=view != stored))


# ---- vLLM targets: the per-object re-targeting of an HF plan (before targets/vllm_columns.py)

def _intersect(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def _source_part(op: CopyOp, part: Box) -> Box:
    """The sub-box of ``op.src_box`` whose bytes land on ``part`` (a sub-box of ``op.dst_box``)."""
    if not op.transpose:
        return Box(tuple(s + p - d for s, p, d in zip(op.src_box.offsets, part.offsets, op.dst_box.offsets)),
                   part.lengths)
    # transposed: the source's last two dims are the target's last two, swapped; leading dims are 1
    (d0, d1), (p0, p1), (n0, n1) = op.dst_box.offsets[-2:], part.offsets[-2:], part.lengths[-2:]
    lead = op.src_box.offsets[:-2]
    s0, s1 = op.src_box.offsets[-2:]
    return Box(lead + (s0 + p1 - d1, s1 + p0 - d0), (1,) * len(lead) + (n1, n0))


def _placed(piece: VllmPiece, part: Box) -> Box:
    """Where ``part`` (a sub-box of ``piece.hf_box``) lands in the parameter."""
    k = len(piece.param_box.offsets) - len(piece.hf_box.offsets)  # leading expert-slot dims
    return Box(piece.param_box.offsets[:k] + tuple(p + i - h for p, i, h in zip(
        piece.param_box.offsets[k:], part.offsets, piece.hf_box.offsets)), (1,) * k + part.lengths)


def reference_retarget(hf_plan: Plan, typed: dict, produced: set, dtype: str, steps: list, digest: str) -> Plan:
    """plan_megatron_to_vllm's loop as it was: every HF op of every piece, one object each."""
    by_hf = hf_plan.ops_by_target
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    for name, (param, pdtype) in typed.items():
        dst = TensorRef(None, name)
        shape = param.shape
        meta = hf_plan.targets[TensorRef(None, param.pieces[0].hf_name)] if param.pieces else None
        tdtype = pdtype or (meta.dtype if meta is not None else dtype)
        if name in produced:
            targets[dst] = TensorMeta(shape, tdtype)
            continue
        written, mine = 0, []
        for piece in param.pieces:
            for op in by_hf[TensorRef(None, piece.hf_name)]:
                part = _intersect(op.dst_box, piece.hf_box)
                if part is None:
                    continue
                src_shape = hf_plan.sources[op.src].shape
                mine.append(make_op(op.src, src_shape, _source_part(op, part), dst, shape, _placed(piece, part),
                                    op.itemsize, transpose=op.transpose, src_view=op.src_view is not None))
                written += part.numel
        ops += merge_ops(mine, hf_plan.sources, {dst: TensorMeta(shape, tdtype)})
        zero = ()
        total = 1
        for n in shape:
            total *= n
        if written < total:  # vocab padding rows past vocab_size (the only part no HF element lands in)
            filled = sum(p.param_box.lengths[0] for p in param.pieces)
            zero = (Box.rows(shape, filled, shape[0] - filled),)
        targets[dst] = TensorMeta(shape, tdtype, zero)
    plan = Plan("megatron_to_vllm", hf_plan.dims, hf_plan.layout, dtype, hf_plan.sources, targets, tuple(ops),
                digest, tuple(steps))
    validate_plan(plan)
    return plan
