"""An independent export planner: one Python object per source tensor and per op, its shard
geometry written here from Megatron-Core's layout conventions, for tests/test_plan_columns.py to
compare the columnar planner (:mod:`megarefit.planner.megatron_to_hf`) against, op for op.

It imports nothing of megarefit's layout geometry, planner or targets. From megarefit it takes
the family's name table (rows: Megatron pattern, role name, HF names, shape symbols, through
``ModelDims.spec``), the config's sizes and layer kinds (``ModelDims``), the trainer's sizes
(``SourceLayout``'s fields), the plain ``Box`` / ``RankCoord`` tuples and the plan's data types
and op constructors (``make_op`` / ``merge_ops``: byte offsets and merging are the plan's
encoding, not geometry). Megatron-Core's conventions::

    ranks        tp fastest: stage-local rank r is tp rank r % tp, expert ep rank (r // etp) % ep
    column       rank r holds rows [r*n/tp, (r+1)*n/tp)       row: columns, the same
    vocab        rows split over the padded vocab; rows >= vocab_size are padding
    qkv          per query group g: [q_g (hq*d rows); k_g (d); v_g (d)], then split by rows
    gated mlp    rank r holds [gate_r; up_r]
    experts      ep rank e holds experts [e*E/ep, (e+1)*E/ep), split over etp like the dense roles
    legacy grouped  weight1 [h, E_l*2F/etp] = per expert [gate_r^T | up_r^T]; weight2 [E_l*F/etp, h]
    gpt-oss fused   HF [E, in, out] per expert (gate / up interleaved on the last dim), Megatron [out, in]
"""

from __future__ import annotations

import math
from collections import defaultdict

from megarefit import Box, ModelDims, RankCoord, SourceLayout
from megarefit.plan import CopyOp, Plan, TensorMeta, TensorRef, digest_of, itemsize, make_op, merge_ops, validate_plan

ROWS_SPLIT = {"column", "vocab", "qkv", "gated_mlp", "expert_gated_mlp", "expert_column", "segmented",
              "expert_gate_up_fused", "grouped_expert_fc2"}  # split on dim 0 over tp (etp for experts)
COLS_SPLIT = {"row", "expert_row", "expert_row_fused", "grouped_expert_fc1"}  # split on dim 1
FUSED = {"expert_gate_up_fused", "expert_row_fused", "expert_replicated_fused"}
GROUPED = {"grouped_expert_fc1", "grouped_expert_fc2"}


def _is_expert(role: str) -> bool:
    return role.startswith(("expert_", "grouped_expert_"))


def _rows(shape, start, n) -> Box:
    return Box((start,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))


def _full(shape) -> Box:
    return Box((0,) * len(shape), tuple(shape))


class _Geometry:
    """Shapes and row runs of one model under one trainer layout."""

    def __init__(self, dims: ModelDims, layout: SourceLayout):
        self.dims, self.layout = dims, layout
        self.per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
        n = math.lcm(layout.tp, layout.etp * layout.ep)  # the (tp, ep) pairs of one stage
        self.pairs = sorted({(r % layout.tp, (r // layout.etp) % layout.ep) for r in range(n)})

    def expert_tps(self, ep: int) -> list[int]:
        return [t for t, e in self.pairs if e == ep]

    def dense_ep(self, tp: int) -> int:  # the copy of a dense shard read: stage-local rank r = tp
        return (tp // self.layout.etp) % self.layout.ep

    def split(self, spec) -> int:
        return self.layout.etp if _is_expert(spec.role.value) else self.layout.tp

    def whole(self, spec) -> tuple[int, ...]:  # at tp 1, vocab padded (grouped: one expert's block)
        return tuple(self.dims.size(s, padded_vocab=self.layout.padded_vocab_size) for s in spec.shape)

    def view(self, spec) -> tuple[int, ...]:  # legacy grouped: [E_l, h, 2F/etp] / [E_l, F/etp, h]
        a, b = self.whole(spec)
        etp = self.layout.etp
        return (self.per_ep, a, b // etp) if spec.role.value == "grouped_expert_fc1" else (self.per_ep, a // etp, b)

    def local(self, spec) -> tuple[int, ...]:
        role, shape, k = spec.role.value, self.whole(spec), self.split(spec)
        if role in GROUPED:
            e, a, b = self.view(spec)
            return (a, e * b) if role == "grouped_expert_fc1" else (e * a, b)
        if role in ROWS_SPLIT:
            return (shape[0] // k,) + shape[1:]
        return (shape[0], shape[1] // k) if role in COLS_SPLIT else shape

    def hf_shapes(self, spec) -> list[tuple[int, ...]]:
        role, shape, d = spec.role.value, self.whole(spec), self.dims
        if role == "qkv":
            q, kv = d.num_attention_heads * d.head_dim, d.num_query_groups * d.head_dim
            return [(q,) + shape[1:], (kv,) + shape[1:], (kv,) + shape[1:]]
        if role in ("gated_mlp", "expert_gated_mlp"):
            return [(shape[0] // 2,) + shape[1:]] * 2
        if role == "grouped_expert_fc1":
            return [(shape[1] // 2, shape[0])] * 2
        if role == "grouped_expert_fc2":
            return [(shape[1], shape[0])]
        return [(d.vocab_size,) + shape[1:]] if role == "vocab" else [shape]

    def runs(self, spec, names, r: int) -> list[tuple[str, int, int, int, bool]]:
        """``(HF name, local start, HF start, length, columns)`` of TP rank ``r``'s local tensor."""
        role, shape, k = spec.role.value, self.whole(spec), self.split(spec)
        r = r if k > 1 else 0
        n = shape[0] // k
        if role == "replicated" and spec.head_rotate:  # Megatron head [nope; rope] -> HF [rope; nope]
            head, rope = (self.dims.size(s) for s in spec.head_rotate)
            return [x for h in range(0, shape[0], head)
                    for x in ((names[0], h + head - rope, h, rope, False), (names[0], h, h + rope, head - rope, False))]
        if role == "replicated":
            return [(names[0], 0, 0, shape[0], False)]
        if role == "column":
            return [(names[0], 0, r * n, n, False)]
        if role in ("row", "expert_row"):
            return [(names[0], 0, r * (shape[1] // k), shape[1] // k, True)]
        if role == "vocab":
            keep = min(n, self.dims.vocab_size - r * n)
            return [(names[0], 0, r * n, keep, False)] if keep > 0 else []
        if role in ("gated_mlp", "expert_gated_mlp"):
            return [(names[0], 0, r * n // 2, n // 2, False), (names[1], n // 2, r * n // 2, n // 2, False)]
        if role == "qkv":
            return self._qkv(names, r * n, (r + 1) * n)
        sizes = [self.dims.size(s) for s in (spec.segments or spec.shape[:1])]  # segmented, expert_column
        return [(names[0], sum(sizes[:i]) // k, sum(sizes[:i]) + r * size // k, size // k, False)
                for i, size in enumerate(sizes)]

    def _qkv(self, names, lo: int, hi: int) -> list[tuple[str, int, int, int, bool]]:
        d, g = self.dims.head_dim, self.dims.num_query_groups
        hq = self.dims.num_attention_heads // g
        out = []
        for row in range(lo, hi):  # one run per row, joined below
            group, at = divmod(row, (hq + 2) * d)
            which, dst = (0, group * hq * d + at) if at < hq * d else (1 + (at - hq * d) // d, group * d + at % d)
            last = out[-1] if out else None
            if last and last[0] == names[which] and last[2] + last[3] == dst:
                out[-1] = (last[0], last[1], last[2], last[3] + 1, False)
            else:
                out.append((names[which], row - lo, dst, 1, False))
        return out


def _stage(spec) -> str:
    if spec.megatron.startswith("mtp.layers."):
        return "mtp"
    if "{layer}" in spec.megatron:
        return "layer"
    return "first" if spec.megatron.startswith("embedding.") else "last"


def _tensors(g: _Geometry):
    """``(rank, Megatron name, row, global layer, global expert, duplicate)`` of every tensor each rank
    holds, in ``named_parameters()`` order: stage p holds its ``stage_layers[p]`` layers, the first
    the embedding, the last the final norm, output layer and MTP layers (HF layer ``num_layers + i``,
    after a kept-in-sync embedding copy on a last stage that is not the first)."""
    dims, layout = g.dims, g.layout
    rows = dims.spec.rows(dims.conditions(layout.pp, layout.megatron), layout.layer_spec, layout.expert_layout)
    for p in range(layout.pp):
        first, last = p == 0, p == layout.pp - 1
        parts = [("first", [None])] if first else []
        parts.append(("layer", range(layout.stage_layers[p])))
        if last:
            parts += [("last", [None]), ("mtp", range(layout.mtp_layers))]
        for t, e in g.pairs:
            rank = RankCoord(t, p, e)
            for stage, layers in parts:
                if stage == "mtp" and layout.mtp_layers and not first:
                    for row in (r for r in rows if _stage(r) == "first"):
                        yield rank, row.megatron_name(), row, None, None, True
                for local in layers:
                    glob = None if local is None else (
                        dims.num_layers + local if stage == "mtp" else sum(layout.stage_layers[:p]) + local)
                    for row in rows:
                        if _stage(row) != stage or row.layer_kind not in (None, None if glob is None
                                                                           else dims.layer_kind(glob)):
                            continue
                        if "{expert}" in row.megatron:
                            for i in range(g.per_ep):
                                yield rank, row.megatron_name(local, i), row, glob, e * g.per_ep + i, row.duplicate
                        else:
                            yield rank, row.megatron_name(local), row, glob, None, row.duplicate


def reference_megatron_to_hf(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                             experts: frozenset[int] | None = None) -> Plan:
    """``plan_megatron_to_hf`` from :class:`_Geometry`: targets in first-seen order, ops merged per
    target (the same sources, targets and ops, as sets, as the columnar planner)."""
    g = _Geometry(dims, layout)
    tensors = list(_tensors(g))
    sources = {TensorRef(rank, name): TensorMeta(g.local(row), row.dtype or dtype)
               for rank, name, row, *_ in tensors}
    targets: dict[TensorRef, TensorMeta] = {}
    by_target: dict[TensorRef, list[CopyOp]] = defaultdict(list)
    replicas: dict[int, int] = defaultdict(int)  # replicated tensors read round-robin over tp, per stage

    def emit(tdtype, src, sshape, sbox, name, hshape, dbox, stored=None, **kw):
        dst = TensorRef(None, name)
        targets.setdefault(dst, TensorMeta(hshape, tdtype, storage_shape=stored))
        by_target[dst].append(make_op(src, sshape, sbox, dst, hshape, dbox, itemsize(tdtype), **kw))

    for rank, name, row, layer, expert, duplicate in tensors:
        role, src, tdtype = row.role.value, TensorRef(rank, name), row.dtype or dtype
        if duplicate or (not _is_expert(role) and rank.ep != g.dense_ep(rank.tp)):
            continue  # a kept-in-sync copy; a dense tensor's copy on another ep rank
        if experts is not None and expert is not None and expert not in experts:
            continue
        if _is_expert(role) and layout.etp == 1 and layout.tp > 1:
            tps = g.expert_tps(rank.ep)
            if rank.tp != tps[0]:
                continue  # whole experts on every tp rank: spread over the tp ranks that exist
            if role not in GROUPED:
                rank = RankCoord(tps[expert % len(tps)], rank.pp, rank.ep)
                src = TensorRef(rank, name)
        if role in GROUPED:
            _grouped(g, src, row, layer, experts, tdtype, sources, emit)
        elif role in FUSED:
            if role == "expert_replicated_fused" and layout.etp > 1 and rank.tp != g.expert_tps(rank.ep)[0]:
                continue  # whole on every expert-tp rank: read from the first
            _fused(g, src, row, layer, expert, experts, tdtype, emit)
        else:
            if role == "replicated":
                if rank.tp != 0:
                    continue
                k = replicas[rank.pp] % layout.tp
                replicas[rank.pp] += 1
                src = TensorRef(RankCoord(k, rank.pp, g.dense_ep(k)), name)
            names, local = row.hf_names(layer, expert), g.local(row)
            shapes = dict(zip(names, g.hf_shapes(row)))
            for hf_name in names:
                targets.setdefault(TensorRef(None, hf_name), TensorMeta(shapes[hf_name], tdtype))
            for hf_name, s, d, n, cols in g.runs(row, names, src.rank.tp):
                shape = shapes[hf_name]
                sbox, dbox = (_full(local), Box((0, d), (shape[0], n))) if cols else (_rows(local, s, n),
                                                                                     _rows(shape, d, n))
                emit(tdtype, src, local, sbox, hf_name, shape, dbox)
    ops = [op for ref in targets for op in merge_ops(by_target[ref], sources, targets)]
    plan = Plan("megatron_to_hf", dims, layout, dtype, sources, targets, tuple(ops),
                digest_of("megatron_to_hf", dims.to_dict(), layout.to_dict(), dtype,
                          None if experts is None else sorted(experts)))
    validate_plan(plan)
    return plan


def _grouped(g: _Geometry, src, row, layer, experts, tdtype, sources, emit) -> None:
    """Legacy GroupedMLP: local expert j of the view is [gate_r^T | up_r^T] (weight1) or down_r^T
    (weight2, ``down_r`` = ``down_proj[:, r*F_l:(r+1)*F_l]``): transposed copies."""
    view, rank = g.view(row), src.rank
    sources[src] = TensorMeta(view, tdtype, storage_shape=g.local(row))
    r = rank.tp if g.layout.etp > 1 else 0
    hf_shape = g.hf_shapes(row)[0]
    for j in range(view[0]):
        e = rank.ep * g.per_ep + j
        if experts is not None and e not in experts:
            continue
        names = row.hf_names(layer, e)
        if row.role.value == "grouped_expert_fc1":
            h, f = view[1], view[2] // 2
            for k in range(2):
                emit(tdtype, src, view, Box((j, 0, k * f), (1, h, f)), names[k], hf_shape, _rows(hf_shape, r * f, f),
                     transpose=True, src_view=True)
        else:
            f, h = view[1], view[2]
            emit(tdtype, src, view, Box((j, 0, 0), (1, f, h)), names[0], hf_shape, Box((0, r * f), (h, f)),
                 transpose=True, src_view=True)


def _fused(g: _Geometry, src, row, layer, expert, experts, tdtype, emit) -> None:
    """gpt-oss: expert ``expert``'s Megatron [out, in] weight (or bias) into the HF tensor holding
    every owned expert, [E, in, out] (gate_up viewed [E, h, f, 2]: gate at even, up at odd columns)."""
    dims, role = g.dims, row.role.value
    owned = sorted(range(dims.num_experts) if experts is None else (e for e in experts if e < dims.num_experts))
    slot, local, whole = owned.index(expert), g.local(row), g.whole(row)
    stored = (len(owned),) + (whole[::-1] if len(whole) == 2 else whole)
    view = stored[:-1] + (stored[-1] // 2, 2) if role == "expert_gate_up_fused" else stored
    r, matrix = (src.rank.tp if g.layout.etp > 1 else 0), len(local) == 2
    if role == "expert_gate_up_fused":
        f = local[0] // 2
        lead = ((slot, 0), (1, local[1])) if matrix else ((slot,), (1,))
        copies = [(_rows(local, k * f, f), Box(lead[0] + (r * f, k), lead[1] + (f, 1)), matrix) for k in range(2)]
    elif role == "expert_row_fused":
        h, f = local
        copies = [(_full(local), Box((slot, r * f, 0), (1, f, h)), True)]
    else:
        per = local[::-1] if matrix else local
        copies = [(_full(local), Box((slot,) + (0,) * len(per), (1,) + per), matrix)]
    for sbox, dbox, tr in copies:
        emit(tdtype, src, local, sbox, row.hf_names(layer)[0], view, dbox, None if view == stored else stored,
             transpose=tr, dst_view=view != stored)


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


def _placed(piece, part: Box) -> Box:
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
