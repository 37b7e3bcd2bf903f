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
from typing import Literal, NamedTuple

import torch

from megarefit.errors import LayoutError, PlanValidationError
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import (
    ExpertWeights,
    check_source,
    fused_boxes,
    fused_shapes,
    grouped_boxes,
    hf_shapes,
    local_shape,
    piece_boxes,
    pieces,
    view_shape,
)
from megarefit.layout.parallel import RankCoord, SourceLayout
from megarefit.plan import (
    STAGING_SUFFIX,
    Plan,
    TensorMeta,
    TensorRef,
    ValueStep,
    digest_of,
    itemsize,
    make_op,
    validate_plan,
)
from megarefit.plan.columns import PlanColumns, plan_threads
from megarefit.plan.table import OpTable, TensorGroup, TensorTable
from megarefit.specs.table import ParamSpec, Role, Stage

_PARTS = (Stage.FIRST, Stage.LAYER, Stage.LAST, Stage.MTP)

# Which HF tensors an export plans: every one; those vLLM's target model loads (all but the
# MTP layers, which its loader skips); or those its MTP draft model loads (the MTP layers).
ModelPart = Literal["all", "model", "draft"]
MODEL_PARTS: tuple[ModelPart, ...] = ("all", "model", "draft")
_I64 = torch.int64


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """``xs`` concatenated (an empty int64 column where there are none)."""
    return torch.cat(xs) if xs else torch.zeros(0, dtype=_I64)


def _rep(values: list[int], counts: torch.Tensor) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as one int64 column ``[counts.sum()]``."""
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
            keep = [(lo, g) for lo, g in pairs if dims.has_row(row, g)]
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


_StageRows = list[tuple[ParamSpec, tuple[int, ...], tuple[int, ...]]]  # (row, local layers, global layers)
_Entry = tuple  # (k, j, src off, src len, dst off, dst len, scratch, src flat, dst flat, transpose, itemsize, ndim ok)


class _Sources(NamedTuple):
    """The source table and, per source group ``(rank, row)`` in table group order, what the ops need."""

    table: TensorTable
    where: list[tuple[RankCoord, ParamSpec, tuple[int, ...]]]  # (rank, row, global layers)
    count: list[int]  # instances: layers x local experts
    nexp: list[int]  # local experts per layer (1: not per expert)
    base: dict[tuple[RankCoord, int], int]  # (rank, id(row)) -> first source row


class _Targets(NamedTuple):
    """The target table and what finds a target id from ``(row, k, layer, expert)``."""

    table: TensorTable
    first: dict[tuple[ParamSpec, int], int]  # (row, k) -> first unpermuted target row
    lpos: dict[ParamSpec, torch.Tensor]  # per row, [layers + 2]: global layer + 1 -> position (-1: none)
    epos: dict[ParamSpec, torch.Tensor]  # per row, [experts + 2]: global expert + 1 -> position (-1: not owned)
    t_id: torch.Tensor  # [n_targets]: unpermuted target row -> target id (its row in ``table``)
    n_owned: int  # experts this receiver owns
    opos: torch.Tensor  # [experts + 2]: global expert + 1 -> its slot in a fused target (-1: not owned)
    weights: ExpertWeights  # how fused targets store each expert's weight


class _Reads(NamedTuple):
    """How a rank reads one source group's ``n`` instances (all ``[n]``)."""

    lay: torch.Tensor  # global layer
    exp: torch.Tensor  # global expert (-1: none; grouped rows: the rank's first expert, + the entry's j)
    src: torch.Tensor  # source id read
    tp_rank: int  # the TP rank whose template applies


def _layout_stages(dims: ModelDims, layout: SourceLayout, part: ModelPart = "all",
                   ) -> tuple[tuple[ParamSpec, ...], list[_StageRows]]:
    """The spec-table rows for ``layout`` and each pipeline stage's rows (:func:`_stage_rows`)
    of model part ``part``, once the layout is checked against the model.

    Raises:
        LayoutError: tp/pp/ep do not fit the model; an unknown part; ``"draft"`` where the
            trainers' MTP layers are not the HF config's (see :func:`check_draft_layers`).
        UnverifiedMegatronError: see :func:`~megarefit.layout.geometry.check_source`.
    """
    rows = check_source(dims, layout)
    if part not in MODEL_PARTS:
        raise LayoutError(f"model part {part!r}: expected one of {MODEL_PARTS}")
    if part == "draft":
        check_draft_layers(dims, layout)
    stages = [_stage_rows(dims, layout, rows, p) for p in range(layout.pp)]
    if part != "all":
        stages = [[s for s in stage if (s[0].stage is Stage.MTP) == (part == "draft")] for stage in stages]
    return rows, stages


def check_draft_layers(dims: ModelDims, layout: SourceLayout) -> None:
    """Raise :class:`LayoutError` unless the trainers publish every MTP layer vLLM's draft
    model holds (Megatron ``mtp_num_layers`` == HF ``num_nextn_predict_layers`` > 0)."""
    dims.check_draft()
    if layout.mtp_layers != dims.mtp_layers:
        raise LayoutError(f"vLLM's MTP draft model has {dims.mtp_layers} layer(s) (num_nextn_predict_layers) but "
                          f"the trainers publish {layout.mtp_layers} (Megatron mtp_num_layers): train with "
                          f"mtp_num_layers={dims.mtp_layers} to refit the draft model, or serve without it")


def _source_meta(row: ParamSpec, viewed: bool, dims: ModelDims, layout: SourceLayout, dtype: str) -> TensorMeta:
    """A source tensor's meta: its local shard shape, addressed through the row's view where ``viewed``."""
    shape, tdtype = local_shape(row, dims, layout), row.dtype or dtype
    return (TensorMeta(view_shape(row, dims, layout), tdtype, storage_shape=shape)  # type: ignore[arg-type]
            if viewed else TensorMeta(shape, tdtype))


def _build_sources(dims: ModelDims, layout: SourceLayout, dtype: str, stages: list[_StageRows], per_ep: int,
                   ) -> _Sources:
    """Source tensors: one group per (rank, row), ranks in ``layout.ranks()`` order, instances
    layer-major, then local expert; columns group / layer / expert ``[n_sources]``."""
    groups: list[TensorGroup] = []
    g_count, g_nexp, g_pool = [], [], []
    pool: list[int] = []  # every distinct tuple of local layers, concatenated
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
                meta = metas[(id(row), viewed)] = _source_meta(row, viewed, dims, layout, dtype)
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
    return _Sources(TensorTable(groups, s_group, s_layer, s_expert), where, g_count, g_nexp, base)


def _build_targets(dims: ModelDims, layout: SourceLayout, dtype: str, rows: tuple[ParamSpec, ...],
                   stages: list[_StageRows], owned: list[int], weights: ExpertWeights = "in_out") -> _Targets:
    """Target tensors: one group per (row, HF name k), instances the row's global layers x
    ``owned`` experts, permuted into the module docstring's target order."""
    row_layers: dict[ParamSpec, set[int]] = defaultdict(set)
    for stage in stages:
        for row, _, globs in stage:
            if not row.duplicate:
                row_layers[row].update(globs)
    t_groups: list[TensorGroup] = []
    t_first: dict[tuple[ParamSpec, int], int] = {}
    lpos_of: dict[ParamSpec, torch.Tensor] = {}
    epos_of: dict[ParamSpec, torch.Tensor] = {}
    t_rows, t_keys = [], []
    n_layers_all = dims.num_layers + dims.mtp_layers + 1
    nt = 0
    packs: dict[str, tuple[ParamSpec, list[int]]] = {}  # HF template -> the packed row that made its targets
    for pos, row in enumerate(r for r in rows if r in row_layers):
        layers = sorted(row_layers[row])
        if row.role.is_fused and not owned:
            continue  # a receiver owning no expert holds no fused expert tensor
        exps = owned if (row.per_expert or row.role.is_grouped) and not row.role.is_fused else [-1]
        lpos = torch.full((n_layers_all + 1,), -1, dtype=_I64)
        lpos[torch.tensor(layers) + 1] = torch.arange(len(layers))
        epos = torch.full((dims.num_experts + 2,), -1, dtype=_I64)
        epos[torch.tensor(exps, dtype=_I64) + 1] = torch.arange(len(exps))
        lpos_of[row], epos_of[row] = lpos, epos
        if row.pack is not None and _shares_target(row, layers, packs, t_first):
            continue
        shapes, tdtype = hf_shapes(row, dims, layout), row.dtype or dtype
        part = _PARTS.index(row.stage)
        for k in range(len(row.hf)):
            t_first[(row, k)] = nt
            meta = _target_meta(row, k, shapes, len(owned), dims, layout, tdtype, weights)
            # a row with a value rule: the ops fill a staging target, a value step the HF tensor after it
            for suffix, key in ((STAGING_SUFFIX, k), ("", k + 4)) if row.value else (("", k),):
                t_groups.append(TensorGroup(None, row, k, meta, suffix))
                t_rows.append((len(t_groups) - 1, layers, exps))
                t_keys.append((part, pos, key))
                nt += len(layers) * len(exps)
    group, layer, expert, t_id = _target_order(t_rows, t_keys, n_layers_all, len(rows) + 1, dims.num_experts + 2)
    opos = torch.full((dims.num_experts + 2,), -1, dtype=_I64)
    opos[torch.tensor(owned, dtype=_I64) + 1] = torch.arange(len(owned))
    return _Targets(TensorTable(t_groups, group, layer, expert), t_first, lpos_of, epos_of, t_id, len(owned), opos,
                    weights)


def _shares_target(row: ParamSpec, layers: list[int], packs: dict[str, tuple[ParamSpec, list[int]]],
                   t_first: dict[tuple[ParamSpec, int], int]) -> bool:
    """Whether packed ``row``'s HF tensor already has targets (another part's row made them): then ``row``
    writes into those. The first part's row registers itself in ``packs`` and makes them.

    Raises:
        PlanValidationError: the parts of one HF tensor exist in different layers (a spec-table bug)."""
    owner = packs.setdefault(row.hf[0], (row, layers))
    if owner[0] is row:
        return False
    if owner[1] != layers:
        raise PlanValidationError(f"packed rows {owner[0].megatron!r} and {row.megatron!r} of {row.hf[0]!r} exist "
                                  f"in different layers ({owner[1][:4]} vs {layers[:4]})")
    t_first[(row, 0)] = t_first[(owner[0], 0)]
    return True


def _value_steps(table: TensorTable) -> tuple[ValueStep, ...]:
    """One value step per staging target of ``table`` (rows with a value rule): staging -> the HF tensor."""
    staged = [i for i, g in enumerate(table.groups) if g.suffix == STAGING_SUFFIX]
    if not staged:
        return ()
    rows = torch.nonzero(torch.isin(table.group, torch.tensor(staged, dtype=_I64))).flatten().tolist()
    refs = [table.ref(i) for i in rows]
    return tuple(ValueStep(ref, TensorRef(None, ref.name.removesuffix(STAGING_SUFFIX)),
                           table.groups[int(table.group[i])].spec.value)  # type: ignore[arg-type]
                 for i, ref in zip(rows, refs))


def _target_meta(row: ParamSpec, k: int, shapes: tuple[tuple[int, ...], ...], owned: int, dims: ModelDims,
                 layout: SourceLayout, tdtype: str, weights: ExpertWeights) -> TensorMeta:
    """The meta of HF name ``k`` of ``row``: a fused role's tensor holds the ``owned`` experts,
    addressed through its view where that differs from the stored shape."""
    if row.role.is_fused:
        view, stored = fused_shapes(row, dims, layout, owned, weights)
        return TensorMeta(view, tdtype, storage_shape=None if view == stored else stored)
    return TensorMeta(shapes[0 if row.role.is_grouped else k], tdtype)


def _target_order(t_rows: list[tuple[int, list[int], list[int]]], t_keys: list[tuple[int, int, int]],
                  n_layers_all: int, n_rows: int, n_exp: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target columns group / layer / expert ``[n_targets]`` sorted by (part, layer, row, expert, k),
    and ``t_id`` ``[n_targets]``: unpermuted row (groups in creation order, layer-major) -> sorted row.

    ``t_rows``: per group ``(group, layers, experts)``; ``t_keys``: per group ``(part, row position, k)``.
    """
    t_group, t_layer, t_expert, t_key = [], [], [], []
    for (g, layers, exps), (part, pos, k) in zip(t_rows, t_keys):
        lay = torch.tensor(layers, dtype=_I64).repeat_interleave(len(exps))
        exp = torch.tensor(exps, dtype=_I64).repeat(len(layers))
        t_group.append(torch.full_like(lay, g))
        t_layer.append(lay)
        t_expert.append(exp)
        t_key.append((((part * (n_layers_all + 1) + lay + 1) * n_rows + pos) * n_exp + exp + 1) * 8 + k)
    order = torch.argsort(_cat(t_key), stable=True)
    t_id = torch.empty_like(order)
    t_id[order] = torch.arange(len(order))
    return _cat(t_group)[order], _cat(t_layer)[order], _cat(t_expert)[order], t_id


def _pad(t: tuple[int, ...], fill: int, width: int) -> list[int]:
    """``t`` left-padded with ``fill`` to ``width`` entries."""
    return [fill] * (width - len(t)) + list(t)


def _template_entries(row: ParamSpec, tp_rank: int, src_meta: TensorMeta, dims: ModelDims, layout: SourceLayout,
                      dtype: str, width: int, weights: ExpertWeights = "in_out") -> list[_Entry]:
    """The template of ``(row, tp_rank)``: one entry (see ``_Entry``) per op that an instance of ``row``
    read on TP rank ``tp_rank`` makes; ``k``: its HF name, ``j``: its local expert (grouped rows, else 0),
    boxes left-padded to ``width`` dims, flat offsets and kind from :func:`~megarefit.plan.make_op`."""
    item = itemsize(row.dtype or dtype)
    shapes = hf_shapes(row, dims, layout)
    view = src_meta.shape
    if row.role.is_grouped:
        boxes = [(k, j, sb, shapes[0], db, True) for j, k, sb, db in grouped_boxes(row, dims, layout, tp_rank)]
    elif row.role.is_fused:  # target boxes at expert slot 0; _broadcast shifts them to the expert's slot
        dshape = fused_shapes(row, dims, layout, dims.num_experts, weights)[0]
        boxes = [(0, 0, sb, dshape, db, tr) for sb, db, tr in fused_boxes(row, dims, layout, tp_rank, weights)]
    else:
        names = tuple(str(k) for k in range(len(row.hf)))  # placeholders: k is all a template needs
        boxes = []
        for p in pieces(row, names, dims, layout, tp_rank):
            k = int(p.hf_name)
            sb, db = piece_boxes(p, view, shapes[k])
            boxes.append((k, 0, sb, shapes[k], db, False))
    out: list[_Entry] = []
    for k, j, sb, dshape, db, tr in boxes:
        op = make_op(None, view, sb, None, dshape, db, item, transpose=tr)  # type: ignore[arg-type]
        out.append((k, j, _pad(sb.offsets, 0, width), _pad(sb.lengths, 1, width), _pad(db.offsets, 0, width),
                    _pad(db.lengths, 1, width), int(op.kind == "scratch"), op.src_offset, op.dst_offset, tr, item,
                    len(sb.offsets) == len(view) and len(db.offsets) == len(dshape)))
    return out


def _group_reads(layout: SourceLayout, src: _Sources, gi: int, turns: list[dict[ParamSpec, list[int]]],
                 per_ep: int) -> _Reads | None:
    """Which instances of source group ``gi`` its rank reads for the plan (``None``: another rank's
    copy is read instead), and from which source ids."""
    rank, row, globs = src.where[gi]
    if row.duplicate or (not row.role.is_expert and rank.ep != layout.dense_ep(rank.tp)):
        return None
    n, nexp = src.count[gi], src.nexp[gi]
    i = torch.arange(n)
    lay = torch.tensor(globs, dtype=_I64).repeat_interleave(nexp)
    exp = (rank.ep * per_ep + i % nexp) if row.per_expert else torch.full((n,), -1, dtype=_I64)
    ids = src.base[(rank, id(row))] + i
    tp_rank = rank.tp
    if row.role.is_grouped:
        if layout.etp == 1 and rank.tp != layout.expert_tps(rank.ep)[0]:
            return None
        exp = torch.full((n,), rank.ep * per_ep, dtype=_I64)  # + the entry's local expert j
    elif row.role is Role.REPLICATED:
        if rank.tp != 0:
            return None
        reader = torch.tensor(turns[rank.pp][row], dtype=_I64) % layout.tp
        bases = torch.tensor([src.base[(RankCoord(t, rank.pp, layout.dense_ep(t)), id(row))]
                              for t in range(layout.tp)])
        ids = bases[reader] + i
    elif row.role is Role.EXPERT_REPLICATED_FUSED and layout.etp > 1:
        if rank.tp != layout.expert_tps(rank.ep)[0]:
            return None  # whole on every expert-TP rank: read from the first
    elif row.role.is_expert and layout.etp == 1 and layout.tp > 1:
        tps = layout.expert_tps(rank.ep)
        if rank.tp != tps[0]:
            return None
        bases = torch.tensor([src.base[(RankCoord(t, rank.pp, rank.ep), id(row))] for t in tps])
        ids = bases[exp % len(tps)] + i
        tp_rank = tps[0]  # whole experts (etp = 1): every TP rank's template is the same
    return _Reads(lay, exp, ids, tp_rank)


def _broadcast(template: list[_Entry], start: int, row: ParamSpec, reads: _Reads, tgt: _Targets,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One source group's ops: its ``n`` read instances x the ``count`` template entries (``[n, count]``),
    flattened, keeping those whose target exists here; columns entry index (``start`` + e), source id, target id,
    and the expert slot a fused target's box moves to (0 for other rows)."""
    n, count = len(reads.lay), len(template)
    if row.role.is_fused:
        slot = tgt.opos[reads.exp + 1]  # [n]
        lp = tgt.lpos[row][reads.lay + 1]
        keep = ((slot >= 0) & (lp >= 0))[:, None].expand(n, count)
        dst = tgt.first[(row, 0)] + lp[:, None].expand(n, count)
        return ((start + torch.arange(count))[None, :].expand(n, count)[keep],
                reads.src[:, None].expand(n, count)[keep], tgt.t_id[dst[keep]], slot[:, None].expand(n, count)[keep])
    ks = torch.tensor([e[0] for e in template], dtype=_I64)
    js = torch.tensor([e[1] for e in template], dtype=_I64)
    e_exp = reads.exp[:, None] + js[None, :]  # [n, count]
    firsts = torch.tensor([tgt.first[(row, int(k))] for k in ks], dtype=_I64)
    lp = tgt.lpos[row][reads.lay + 1][:, None]  # [n, 1]
    ep_ = tgt.epos[row][e_exp + 1]  # [n, count]
    nexp_t = tgt.n_owned if (row.per_expert or row.role.is_grouped) else 1
    keep = (ep_ >= 0) & (lp >= 0)
    dst = firsts[None, :] + lp * nexp_t + ep_
    return ((start + torch.arange(count))[None, :].expand(n, count)[keep], reads.src[:, None].expand(n, count)[keep],
            tgt.t_id[dst[keep]], torch.zeros(int(keep.sum()), dtype=_I64))


def _op_rows(dims: ModelDims, layout: SourceLayout, dtype: str, stages: list[_StageRows], src: _Sources,
             tgt: _Targets, per_ep: int, width: int,
             ) -> tuple[list[_Entry], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every template entry (each ``(row, tp rank)`` template built once), and the unsorted ops as
    ``[n_ops]`` columns template entry, source id, target id, fused expert slot, source group by source group."""
    entries: list[_Entry] = []
    templates: dict[tuple[ParamSpec, int], tuple[int, int]] = {}  # (row, tp rank) -> (first entry, count)
    o_entry, o_src, o_dst, o_slot = [], [], [], []
    turns = [_replicated_turns(stage) for stage in stages]
    for gi, (_, row, _) in enumerate(src.where):
        reads = _group_reads(layout, src, gi, turns, per_ep)
        if reads is None or (row.role.is_fused and (row, 0) not in tgt.first):  # (no expert owned: no target)
            continue
        key = (row, reads.tp_rank)
        if key not in templates:
            new = _template_entries(row, reads.tp_rank, src.table.groups[gi].meta, dims, layout, dtype, width,
                                    tgt.weights)
            templates[key] = (len(entries), len(new))
            entries.extend(new)
        start, count = templates[key]
        if not count:
            continue
        e, s, d, slot = _broadcast(entries[start:start + count], start, row, reads, tgt)
        o_entry.append(e)
        o_src.append(s)
        o_dst.append(d)
        o_slot.append(slot)
    return entries, _cat(o_entry), _cat(o_src), _cat(o_dst), _cat(o_slot)


def _op_columns(entries: list[_Entry], width: int, entry: torch.Tensor, src_id: torch.Tensor, dst_id: torch.Tensor,
                slot: torch.Tensor, sources: TensorTable, targets: TensorTable,
                ) -> tuple[PlanColumns, torch.Tensor, torch.Tensor]:
    """The ops sorted by (target id, target flat offset) as :class:`PlanColumns` (``[n_ops]`` /
    ``[n_ops, width]``, boxes and offsets copied from each op's template entry, target boxes of
    fused experts moved ``slot`` along the target's dim 0), with their itemsize and transpose
    columns ``[n_ops]``."""
    cols_e = list(zip(*entries)) if entries else [()] * 12
    e_t = {name: torch.tensor(cols_e[c], dtype=_I64).reshape(len(entries), -1)
           for c, name in ((2, "so"), (3, "sl"), (4, "do"), (5, "dl"))}
    e_s = {name: torch.tensor(cols_e[c], dtype=_I64) for c, name in ((6, "kind"), (7, "sflat"), (8, "dflat"),
                                                                       (9, "tr"), (10, "item"), (11, "ok"))}
    dflat = e_s["dflat"][entry] if len(entries) else torch.zeros(0, dtype=_I64)
    d_off = e_t["do"][entry] if len(entries) else torch.zeros(0, width, dtype=_I64)
    if bool((slot != 0).any()):
        d_off, dflat = _slot_shifted(d_off, dflat, slot, dst_id, targets, width)
    order = torch.argsort(dst_id * (int(dflat.max()) + 1 if len(dflat) else 1) + dflat, stable=True)
    entry, src_id, dst_id, dflat, d_off = entry[order], src_id[order], dst_id[order], dflat[order], d_off[order]

    def col(name: str) -> torch.Tensor:
        t = e_t.get(name, e_s.get(name))
        if not len(entries):
            return torch.zeros((0, width) if name in e_t else 0, dtype=_I64)
        return t[entry]  # type: ignore[index]

    transpose = col("tr").bool()
    columns = PlanColumns(src_id=src_id, dst_id=dst_id, kind=col("kind"), special=transpose.clone(),
                          src_off=col("so"), src_len=col("sl"), dst_off=d_off, dst_len=col("dl"),
                          ndim_ok=col("ok").bool(), src_flat=col("sflat"), dst_flat=dflat,
                          src_shape=sources.shapes(width), dst_shape=targets.shapes(width),
                          dst_numel=targets.numels())
    return columns, col("item"), transpose


def _slot_shifted(d_off: torch.Tensor, dflat: torch.Tensor, slot: torch.Tensor, dst_id: torch.Tensor,
                  targets: TensorTable, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target offsets ``[n_ops, width]`` and flat offsets ``[n_ops]`` moved ``slot`` along each
    target's dim 0 (its first unpadded dim)."""
    shape = targets.shapes(width)[dst_id]
    lead = (width - targets.ndims()[dst_id])[:, None]
    d_off = d_off.clone()
    d_off.scatter_add_(1, lead, slot[:, None])
    return d_off, dflat + slot * (shape.prod(1) // shape.gather(1, lead).squeeze(1))


def plan_export(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                experts: frozenset[int] | None = None, expert_weights: ExpertWeights = "in_out",
                part: ModelPart = "all") -> Plan:
    """:func:`~megarefit.planner.plan_megatron_to_hf` built on columns (same ops, same
    rules; see the module docstring for the target order). Validated before returning.

    Raises:
        LayoutError: tp/pp/ep do not fit the model.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    rows, stages = _layout_stages(dims, layout, part)
    per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
    src = _build_sources(dims, layout, dtype, stages, per_ep)
    owned = list(range(dims.num_experts)) if experts is None else sorted(e for e in experts
                                                                         if 0 <= e < dims.num_experts)
    tgt = _build_targets(dims, layout, dtype, rows, stages, owned, expert_weights)
    width = max([len(g.meta.shape) for g in src.table.groups] + [len(g.meta.shape) for g in tgt.table.groups] + [1])
    entries, entry, src_id, dst_id, slot = _op_rows(dims, layout, dtype, stages, src, tgt, per_ep, width)
    columns, item, transpose = _op_columns(entries, width, entry, src_id, dst_id, slot, src.table, tgt.table)
    ops = OpTable(columns, src.table, tgt.table, item, transpose)
    plan = Plan("megatron_to_hf", dims, layout, dtype, src.table, tgt.table, ops,  # type: ignore[arg-type]
                digest_of("megatron_to_hf", dims.to_dict(), layout.to_dict(), dtype,
                          None if experts is None else sorted(experts),
                          *(() if expert_weights == "in_out" else (expert_weights,)),
                          *(() if part == "all" else (part,))), transforms=_value_steps(tgt.table))
    validate_plan(plan)
    return plan


@lru_cache(maxsize=64)
def plan_megatron_to_hf(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                        experts: frozenset[int] | None = None, expert_weights: ExpertWeights = "in_out",
                        part: ModelPart = "all") -> Plan:
    """Plan the export of every HF tensor from Megatron shards (full HF tensors as targets).

    ``experts``: the global routed experts this receiver owns (vLLM expert
    parallelism); expert tensors of other experts get no target and no op.
    ``None``: all experts. ``expert_weights``: how targets holding every expert of a layer
    (gpt-oss's fused experts) store each expert's weight: ``"in_out"``, the HF checkpoint's
    layout, or ``"out_in"`` (vLLM's FusedMoE, the pivot of :func:`plan_megatron_to_vllm`);
    see :func:`~megarefit.layout.geometry.fused_shapes`. ``part``: ``"all"`` HF tensors;
    ``"model"``, all but the MTP layers (what vLLM's target model loads: its loader skips
    ``model.layers.{N+i}``); ``"draft"``, the MTP layers only (vLLM's MTP draft model); the
    other part's source tensors are not read.

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
    ``(dims, layout, dtype, experts, expert_weights, part)``.

    Raises:
        LayoutError: tp/pp/ep do not fit the model; ``part="draft"`` where the trainers
            publish no MTP layers or fewer than the HF config stores.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    with plan_threads():
        return plan_export(dims, layout, dtype, experts, expert_weights, part)


__all__ = ["MODEL_PARTS", "ModelPart", "check_draft_layers", "plan_export", "plan_megatron_to_hf"]
