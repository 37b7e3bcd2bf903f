"""Export planning: Megatron shards -> full HF tensors (:func:`plan_megatron_to_hf`), on columns.

Every instance of a spec-table row (one layer, one expert) on a rank is cut the same
way: the geometry of :func:`~megarefit.layout.geometry.pieces` /
:func:`~megarefit.layout.geometry.grouped_boxes` depends on the row and the reading TP rank
only. So the planner computes each ``(row, tp rank)`` **template** once (a few ops with
boxes and flat offsets) and broadcasts it over layers, experts and ranks::

    template (row linear_fc1, tp rank 1)        instances of a source group (rank, row)
    entry 0: k=0 gate  src rows [0, f)    x     layer 0 expert 0 -> source id s0,   targets
    entry 1: k=1 up    src rows [f, 2f)         layer 0 expert 1 -> source id s0+1  gate/up of
                                                 ...                                 (layer, expert)

    ops = instances x entries: source id + instance, target id from (row, k, layer, expert),
          boxes and offsets copied from the entry

Names are never formatted here: sources and targets are
:class:`~megarefit.plan.table.TensorTable` rows ``(group, layer, expert)``. Which rank
reads what follows :func:`~megarefit.planner.plan_megatron_to_hf`'s rules exactly
(replicated tensors from tp ranks in turn, whole experts spread over the TP ranks that
hold them, non-expert tensors from ``dense_ep``); targets are ordered embedding, then
layer by layer (rows in table order, experts ascending, HF names in row order), final
norm and head, then MTP layers; ops grouped by target in that order, ascending target
offset within a target.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from functools import lru_cache

import torch

from megarefit.errors import LayoutError
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import grouped_boxes, hf_shapes, local_shape, piece_boxes, pieces, view_shape
from megarefit.layout.parallel import RankCoord, SourceLayout
from megarefit.plan import Plan, TensorMeta, digest_of, itemsize, make_op, validate_plan
from megarefit.plan.columns import PlanColumns, plan_threads
from megarefit.plan.table import OpTable, TensorGroup, TensorTable
from megarefit.specs.table import ParamSpec, Role, Stage

_PARTS = (Stage.FIRST, Stage.LAYER, Stage.LAST, Stage.MTP)
_I64 = torch.int64


def cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(xs) if xs else torch.zeros(0, dtype=_I64)


def _rep(values: list[int], counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=_I64), counts)


def _stage_rows(dims: ModelDims, layout: SourceLayout, rows: tuple[ParamSpec, ...], pp: int,
                ) -> list[tuple[ParamSpec, tuple[int, ...], tuple[int, ...]]]:
    """``(row, local layers, global layers)`` that pipeline stage ``pp`` holds, parts in
    ``source_tensors`` order; ``-1`` stands for "no layer" (embedding, head); the MTP
    block's kept-in-sync embedding copy appears as a ``duplicate`` row."""
    first, last = pp == 0, pp == layout.pp - 1
    out = []
    for part in _PARTS:
        if (part is Stage.FIRST and not first) or (part in (Stage.LAST, Stage.MTP) and not last):
            continue
        part_rows = [r for r in rows if r.stage is part]
        if part is Stage.LAYER:
            pairs = [(i, layout.layer_offset(pp) + i) for i in range(layout.stage_layers[pp])]
        elif part is Stage.MTP:
            pairs = [(i, dims.num_layers + i) for i in range(layout.mtp_layers)]
            if layout.mtp_layers and not first:
                out += [(dataclasses.replace(r, duplicate=True), (-1,), (-1,)) for r in rows if r.stage is Stage.FIRST]
        else:
            pairs = [(-1, -1)]
        for row in part_rows:
            keep = [(lo, g) for lo, g in pairs
                    if row.layer_kind is None or row.layer_kind == (None if g < 0 else dims.layer_kind(g))]
            if keep:
                out.append((row, tuple(lo for lo, _ in keep), tuple(g for _, g in keep)))
    return out


def _replicated_turns(stage: list[tuple[ParamSpec, tuple[int, ...], tuple[int, ...]]]) -> dict[ParamSpec, list[int]]:
    """Per replicated row of a stage, the ordinal of each of its instances among the
    stage's replicated tensors in ``named_parameters`` order (part, layer, row)."""
    rep = [(row, locs) for row, locs, _ in stage if row.role is Role.REPLICATED and not row.duplicate]
    order = sorted(((_PARTS.index(row.stage), lo, i, row) for i, (row, locs) in enumerate(rep) for lo in locs),
                   key=lambda x: x[:3])
    out: dict[ParamSpec, list[int]] = defaultdict(list)
    for n, (*_, row) in enumerate(order):
        out[row].append(n)
    return out


def plan_export(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                experts: frozenset[int] | None = None) -> Plan:
    """:func:`~megarefit.planner.plan_megatron_to_hf` built on columns (same ops, same
    rules; see the module docstring for the target order). Validated before returning.

    Raises:
        LayoutError: tp/pp/ep do not fit the model.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    dims.check_layout(layout.tp, layout.pp, layout.ep, layout.etp)
    if layout.mtp_layers > dims.mtp_layers:
        raise LayoutError(f"the trainer has mtp_layers={layout.mtp_layers} but the HF config stores "
                          f"{dims.mtp_layers} (num_nextn_predict_layers): nowhere to put the MTP layers")
    rows = dims.spec.rows(dims.conditions(layout.pp), layout.layer_spec, layout.expert_layout)
    per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
    stages = [_stage_rows(dims, layout, rows, p) for p in range(layout.pp)]

    # ---- sources: one group per (rank, row); instances layer-major, then local expert
    groups: list[TensorGroup] = []
    g_count, g_nexp, g_pool = [], [], []
    pool: list[int] = []
    pool_at: dict[tuple[int, ...], int] = {}
    base: dict[tuple[RankCoord, int], int] = {}  # (rank, id(row)) -> first source row
    where: list[tuple[RankCoord, ParamSpec, tuple[int, ...]]] = []
    total = 0
    metas: dict[tuple[int, bool], TensorMeta] = {}  # (id(row), addressed through its view) -> meta
    for rank in layout.ranks():
        for row, locs, globs in stages[rank.pp]:
            viewed = row.role.is_grouped and not row.duplicate and (layout.etp > 1
                                                                    or rank.tp == layout.expert_tps(rank.ep)[0])
            meta = metas.get((id(row), viewed))
            if meta is None:
                shape, tdtype = local_shape(row, dims, layout), row.dtype or dtype
                meta = (TensorMeta(view_shape(row, dims, layout), tdtype, storage_shape=shape)  # type: ignore[arg-type]
                        if viewed else TensorMeta(shape, tdtype))
                metas[(id(row), viewed)] = meta
            nexp = per_ep if row.per_expert else 1
            if locs not in pool_at:
                pool_at[locs] = len(pool)
                pool.extend(locs)
            groups.append(TensorGroup(rank, row, None, meta))
            g_count.append(len(locs) * nexp)
            g_nexp.append(nexp)
            g_pool.append(pool_at[locs])
            base[(rank, id(row))] = total
            where.append((rank, row, globs))
            total += len(locs) * nexp
    counts = torch.tensor(g_count, dtype=_I64)
    s_group = torch.repeat_interleave(torch.arange(len(groups)), counts)
    inst = torch.arange(total) - _rep(torch.cumsum(counts, 0).sub_(counts).tolist(), counts)
    s_nexp = _rep(g_nexp, counts)
    s_layer = torch.tensor(pool or [0], dtype=_I64)[_rep(g_pool, counts) + inst // s_nexp]
    is_exp = _rep([int(g.spec.per_expert) for g in groups], counts).bool()
    s_expert = torch.where(is_exp, inst % s_nexp, -1)
    sources = TensorTable(groups, s_group, s_layer, s_expert)

    # ---- targets: one group per (row, HF name k); instances = layers x owned experts
    owned = list(range(dims.num_experts)) if experts is None else sorted(e for e in experts
                                                                         if 0 <= e < dims.num_experts)
    row_layers: dict[ParamSpec, set[int]] = defaultdict(set)
    for stage in stages:
        for row, _, globs in stage:
            if not row.duplicate:
                row_layers[row].update(globs)
    t_groups: list[TensorGroup] = []
    t_first: dict[tuple[ParamSpec, int], int] = {}  # (row, k) -> first unpermuted target row
    lpos_of: dict[ParamSpec, torch.Tensor] = {}  # global layer + 1 -> position, per row
    epos_of: dict[ParamSpec, torch.Tensor] = {}  # global expert + 1 -> position (-1: not owned), per row
    t_rows, t_keys = [], []
    n_layers_all = dims.num_layers + dims.mtp_layers + 1
    nt = 0
    for pos, row in enumerate(r for r in rows if r in row_layers):
        layers = sorted(row_layers[row])
        exps = owned if (row.per_expert or row.role.is_grouped) else [-1]
        lpos = torch.full((n_layers_all + 1,), -1, dtype=_I64)
        lpos[torch.tensor(layers) + 1] = torch.arange(len(layers))
        epos = torch.full((dims.num_experts + 2,), -1, dtype=_I64)
        epos[torch.tensor(exps, dtype=_I64) + 1] = torch.arange(len(exps))
        lpos_of[row], epos_of[row] = lpos, epos
        shapes, tdtype = hf_shapes(row, dims, layout), row.dtype or dtype
        part = _PARTS.index(row.stage)
        for k in range(len(row.hf)):
            t_first[(row, k)] = nt
            t_groups.append(TensorGroup(None, row, k, TensorMeta(shapes[0 if row.role.is_grouped else k], tdtype)))
            t_rows.append((len(t_groups) - 1, layers, exps))
            t_keys.append((part, pos, k))
            nt += len(layers) * len(exps)
    t_group, t_layer, t_expert, t_key = [], [], [], []
    n_rows, n_exp = len(rows) + 1, dims.num_experts + 2
    for (g, layers, exps), (part, pos, k) in zip(t_rows, t_keys):
        lay = torch.tensor(layers, dtype=_I64).repeat_interleave(len(exps))
        exp = torch.tensor(exps, dtype=_I64).repeat(len(layers))
        t_group.append(torch.full_like(lay, g))
        t_layer.append(lay)
        t_expert.append(exp)
        t_key.append((((part * (n_layers_all + 1) + lay + 1) * n_rows + pos) * n_exp + exp + 1) * 8 + k)
    order = torch.argsort(cat(t_key), stable=True)
    t_id = torch.empty_like(order)
    t_id[order] = torch.arange(len(order))
    targets = TensorTable(t_groups, cat(t_group)[order], cat(t_layer)[order], cat(t_expert)[order])

    # ---- op templates, per (row, reading tp rank); width = widest tensor rank
    width = max([len(g.meta.shape) for g in groups] + [len(g.meta.shape) for g in t_groups] + [1])
    entries: list[tuple] = []  # (k, j, so, sl, do, dl, kind, sflat, dflat, transpose, item, ndim_ok)
    templates: dict[tuple[ParamSpec, int], tuple[int, int]] = {}

    def pad(t: tuple[int, ...], fill: int) -> list[int]:
        return [fill] * (width - len(t)) + list(t)

    def template(row: ParamSpec, tp_rank: int, src_meta: TensorMeta) -> tuple[int, int]:
        key = (row, tp_rank)
        if key not in templates:
            start, item = len(entries), itemsize(row.dtype or dtype)
            shapes = hf_shapes(row, dims, layout)
            if row.role.is_grouped:
                view = src_meta.shape
                boxes = [(k, j, sb, shapes[0], db, True) for j, k, sb, db in grouped_boxes(row, dims, layout, tp_rank)]
            else:
                names = tuple(str(k) for k in range(len(row.hf)))  # placeholders: k is all a template needs
                boxes = []
                for p in pieces(row, names, dims, layout, tp_rank):
                    k = int(p.hf_name)
                    sb, db = piece_boxes(p, src_meta.shape, shapes[k])
                    boxes.append((k, 0, sb, shapes[k], db, False))
                view = src_meta.shape
            for k, j, sb, dshape, db, tr in boxes:
                op = make_op(None, view, sb, None, dshape, db, item, transpose=tr)  # type: ignore[arg-type]
                entries.append((k, j, pad(sb.offsets, 0), pad(sb.lengths, 1), pad(db.offsets, 0), pad(db.lengths, 1),
                                int(op.kind == "scratch"), op.src_offset, op.dst_offset, tr, item,
                                len(sb.offsets) == len(view) and len(db.offsets) == len(dshape)))
            templates[key] = (start, len(entries) - start)
        return templates[key]

    # ---- op groups: which rank reads each source group's instances, and with which template
    o_entry, o_src, o_dst = [], [], []
    turns = [_replicated_turns(stage) for stage in stages]
    for gi, (rank, row, globs) in enumerate(where):
        if row.duplicate or (not row.role.is_expert and rank.ep != layout.dense_ep(rank.tp)):
            continue
        n, nexp = g_count[gi], g_nexp[gi]
        i = torch.arange(n)
        lay = torch.tensor(globs, dtype=_I64).repeat_interleave(nexp)
        exp = (rank.ep * per_ep + i % nexp) if row.per_expert else torch.full((n,), -1, dtype=_I64)
        src = base[(rank, id(row))] + i
        tp_rank = rank.tp
        if row.role.is_grouped:
            if layout.etp == 1 and rank.tp != layout.expert_tps(rank.ep)[0]:
                continue
            exp = torch.full((n,), rank.ep * per_ep, dtype=_I64)  # + the entry's local expert j
        elif row.role is Role.REPLICATED:
            if rank.tp != 0:
                continue
            reader = torch.tensor(turns[rank.pp][row], dtype=_I64) % layout.tp
            bases = torch.tensor([base[(RankCoord(t, rank.pp, layout.dense_ep(t)), id(row))]
                                  for t in range(layout.tp)])
            src = bases[reader] + i
        elif row.role.is_expert and layout.etp == 1 and layout.tp > 1:
            tps = layout.expert_tps(rank.ep)
            if rank.tp != tps[0]:
                continue
            bases = torch.tensor([base[(RankCoord(t, rank.pp, rank.ep), id(row))] for t in tps])
            src = bases[exp % len(tps)] + i
            tp_rank = tps[0]  # whole experts (etp = 1): every TP rank's template is the same
        start, count = template(row, tp_rank, groups[gi].meta)
        if not count:
            continue
        ks = torch.tensor([entries[start + e][0] for e in range(count)], dtype=_I64)
        js = torch.tensor([entries[start + e][1] for e in range(count)], dtype=_I64)
        e_exp = exp[:, None] + js[None, :]  # [n, count]
        firsts = torch.tensor([t_first[(row, int(k))] for k in ks], dtype=_I64)
        lp = lpos_of[row][lay + 1][:, None]
        ep_ = epos_of[row][e_exp + 1]
        nexp_t = len(owned) if (row.per_expert or row.role.is_grouped) else 1
        keep = (ep_ >= 0) & (lp >= 0)
        dst = firsts[None, :] + lp * nexp_t + ep_
        o_entry.append((start + torch.arange(count))[None, :].expand(n, count)[keep])
        o_src.append(src[:, None].expand(n, count)[keep])
        o_dst.append(t_id[dst[keep]])
    entry = cat(o_entry)
    src_id, dst_id = cat(o_src), cat(o_dst)
    cols_e = list(zip(*entries)) if entries else [()] * 12
    e_t = {name: torch.tensor(cols_e[c], dtype=_I64).reshape(len(entries), -1)
           for c, name in ((2, "so"), (3, "sl"), (4, "do"), (5, "dl"))}
    e_s = {name: torch.tensor(cols_e[c], dtype=_I64) for c, name in ((6, "kind"), (7, "sflat"), (8, "dflat"),
                                                                       (9, "tr"), (10, "item"), (11, "ok"))}
    dflat = e_s["dflat"][entry] if len(entries) else torch.zeros(0, dtype=_I64)
    order = torch.argsort(dst_id * (int(dflat.max()) + 1 if len(dflat) else 1) + dflat, stable=True)
    entry, src_id, dst_id = entry[order], src_id[order], dst_id[order]

    def col(name: str) -> torch.Tensor:
        t = e_t.get(name, e_s.get(name))
        if not len(entries):
            return torch.zeros((0, width) if name in e_t else 0, dtype=_I64)
        return t[entry]  # type: ignore[index]

    transpose = col("tr").bool()
    columns = PlanColumns(src_id=src_id, dst_id=dst_id, kind=col("kind"), special=transpose.clone(),
                          src_off=col("so"), src_len=col("sl"), dst_off=col("do"), dst_len=col("dl"),
                          ndim_ok=col("ok").bool(), src_flat=col("sflat"), dst_flat=col("dflat"),
                          src_shape=sources.shapes(width), dst_shape=targets.shapes(width),
                          dst_numel=targets.numels())
    ops = OpTable(columns, sources, targets, col("item"), transpose)
    plan = Plan("megatron_to_hf", dims, layout, dtype, sources, targets, ops,  # type: ignore[arg-type]
                digest_of("megatron_to_hf", dims.to_dict(), layout.to_dict(), dtype,
                          None if experts is None else sorted(experts)))
    validate_plan(plan)
    return plan


@lru_cache(maxsize=64)
def plan_megatron_to_hf(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                        experts: frozenset[int] | None = None) -> Plan:
    """Plan the export of every HF tensor from Megatron shards (full HF tensors as targets).

    ``experts``: the global routed experts this receiver owns (vLLM expert
    parallelism); expert tensors of other experts get no target and no op.
    ``None``: all experts.

    Each HF element is read from exactly one rank. Replicated tensors are read
    from TP ranks in turn (``k % tp`` for the k-th replicated tensor of a stage)
    to spread the load; non-expert tensors from the ``dense_ep`` copy; with
    ``etp == 1`` whole experts are spread over the TP ranks holding them;
    tied-embedding copies on the last stage are not read. Targets come embedding
    first, then layer by layer, final norm and head, then MTP layers; ops are grouped
    by target in that order.

    Built on columns (this module): sources, targets and ops are
    tables whose names are formatted on demand (DeepSeek-V3 tp8 ep64, 642k source
    tensors and 360k ops: ~0.5 s planned and validated on 2 cores). Cached per
    ``(dims, layout, dtype, experts)``.

    Raises:
        LayoutError: tp/pp/ep do not fit the model.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    with plan_threads():
        return plan_export(dims, layout, dtype, experts)


__all__ = ["plan_export", "plan_megatron_to_hf"]
