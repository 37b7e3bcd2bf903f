"""Slice planner: spec table + dims + Megatron layout -> validated :class:`Plan`.

This module is the one place that knows where each row of a sharded Megatron
tensor lands in the HF tensors. Everything else (translator, receiver,
transports) executes plans.

QKV (``linear_qkv``, role ``qkv``); H heads, G query groups, d = head_dim,
hq = H/G. Rows are grouped per query group; TP rank r holds G/tp whole groups::

    Megatron global (tp=1)              HF
    +-------------------+               q_proj [H*d, hidden]   = [q_0; q_1; ...]
    | q_0  (hq*d rows)  |--------+      k_proj [G*d, hidden]   = [k_0; k_1; ...]
    | k_0  (d rows)     |-----+  |      v_proj [G*d, hidden]   = [v_0; v_1; ...]
    | v_0  (d rows)     |--+  |  +----> q_proj rows [0, hq*d)
    | q_1               |  |  +-------> k_proj rows [0, d)
    | k_1               |  +----------> v_proj rows [0, d)
    | v_1               |   ... group g -> q rows [g*hq*d, +hq*d), k/v rows [g*d, +d)
    +-------------------+

Gated MLP (``linear_fc1``, role ``gated_mlp``); f = ffn, rank r of tp::

    rank r local [2f/tp, hidden] = [ gate rows [r*f/tp, (r+1)*f/tp) ;
                                     up   rows [r*f/tp, (r+1)*f/tp) ]
    (so concatenating ranks does NOT give [gate; up])

Vocab (``word_embeddings``, ``output_layer``): rows split over the *padded*
vocab; rows >= HF ``vocab_size`` are padding, trimmed on export and zero on
import. Row-parallel (``linear_proj``, ``linear_fc2``): rank r holds columns
``[r*n/tp, (r+1)*n/tp)``; each op is one contiguous source run landing strided
in the HF tensor, i.e. a scratch copy.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from megarefit.dims import ModelDims
from megarefit.errors import LayoutError, MissingParameterError, UnexpectedParameterError, UnknownParameterError
from megarefit.layout import Box, RankCoord, SourceLayout
from megarefit.plan import CopyOp, Plan, TensorMeta, TensorRef, digest_of, itemsize, make_op, validate_plan
from megarefit.specs.table import LAYER_SPECS, LayerSpec, ParallelMode, ParamSpec, Role, Stage


@dataclass(frozen=True)
class SourceTensor:
    """One Megatron tensor on one rank: its table row, global layer, local shape."""

    spec: ParamSpec
    layer: int | None  # global layer index
    shape: tuple[int, ...]  # local shape on this rank (elements)
    expert: int | None = None  # global expert id


@dataclass(frozen=True)
class Piece:
    """Rows ``[src_start, src_start+length)`` of a local tensor land at HF ``hf_name``
    rows ``[dst_start, ...)``; ``column`` marks a row-parallel piece (dim-1 split)."""

    hf_name: str
    src_start: int
    dst_start: int
    length: int
    column: bool = False


@lru_cache(maxsize=4096)
def global_shape(spec: ParamSpec, dims: ModelDims, layout: SourceLayout) -> tuple[int, ...]:
    """The Megatron tensor's shape at TP=1 (vocab padded)."""
    return tuple(dims.size(s, padded_vocab=layout.padded_vocab_size) for s in spec.shape)


def _split(spec: ParamSpec, layout: SourceLayout) -> int:
    """TP degree that splits this row: ``etp`` for experts, ``tp`` otherwise."""
    return layout.etp if spec.role.is_expert else layout.tp


def view_shape(spec: ParamSpec, dims: ModelDims, layout: SourceLayout) -> tuple[int, ...] | None:
    """The row-major view the plan addresses a grouped-experts tensor through
    (``[E_local, h, 2F/etp]`` for ``weight1``, ``[E_local, F/etp, h]`` for ``weight2``);
    ``None`` for every other row."""
    if not spec.role.is_grouped:
        return None
    per_ep = dims.num_experts // layout.ep
    a, b = global_shape(spec, dims, layout)  # one expert's stored block
    if spec.role is Role.GROUPED_EXPERT_FC1:
        return (per_ep, a, b // layout.etp)
    return (per_ep, a // layout.etp, b)


@lru_cache(maxsize=4096)
def local_shape(spec: ParamSpec, dims: ModelDims, layout: SourceLayout) -> tuple[int, ...]:
    if spec.role.is_grouped:  # stored 2-D: weight1 [h, E_local*2F/etp], weight2 [E_local*F/etp, h]
        e, a, b = view_shape(spec, dims, layout)  # type: ignore[misc]
        return (a, e * b) if spec.role is Role.GROUPED_EXPERT_FC1 else (e * a, b)
    shape = global_shape(spec, dims, layout)
    mode, split = spec.role.parallel_mode, _split(spec, layout)
    dim = {ParallelMode.COLUMN: 0, ParallelMode.ROW: 1}.get(mode)
    if dim is None:
        return shape
    if shape[dim] % split:
        raise LayoutError(f"{spec.megatron}: dim {dim} of shape {shape} does not split over "
                          f"{'etp' if spec.role.is_expert else 'tp'}={split}")
    return shape[:dim] + (shape[dim] // split,) + shape[dim + 1:]


@lru_cache(maxsize=4096)
def hf_shapes(spec: ParamSpec, dims: ModelDims, layout: SourceLayout) -> tuple[tuple[int, ...], ...]:
    """Shapes of the HF tensors a row becomes, in ``spec.hf`` order."""
    shape = global_shape(spec, dims, layout)
    rest = shape[1:]
    if spec.role is Role.QKV:
        q, kv = dims.num_attention_heads * dims.head_dim, dims.num_query_groups * dims.head_dim
        return ((q,) + rest, (kv,) + rest, (kv,) + rest)
    if spec.role in (Role.GATED_MLP, Role.EXPERT_GATED_MLP):
        return ((shape[0] // 2,) + rest,) * 2
    if spec.role is Role.GROUPED_EXPERT_FC1:  # block [h, 2F] -> gate, up [F, h]
        return ((shape[1] // 2, shape[0]),) * 2
    if spec.role is Role.GROUPED_EXPERT_FC2:  # block [F, h] -> down [h, F]
        return ((shape[1], shape[0]),)
    if spec.role is Role.VOCAB:
        return ((dims.vocab_size,) + rest,)
    return (shape,)


def pieces(spec: ParamSpec, names: tuple[str, ...], dims: ModelDims, layout: SourceLayout, tp_rank: int) -> list[Piece]:
    """Where TP rank ``tp_rank``'s local tensor lands in the HF tensors ``names``
    (expert roles split over ``etp``; with ``etp == 1`` every TP rank holds whole experts)."""
    shape = global_shape(spec, dims, layout)
    tp, role = _split(spec, layout), spec.role
    tp_rank = tp_rank if tp > 1 else 0
    n = shape[0] // tp if role.parallel_mode is ParallelMode.COLUMN else shape[0]
    if role is Role.REPLICATED:
        return [Piece(names[0], 0, 0, shape[0])]
    if role is Role.COLUMN:
        return [Piece(names[0], 0, tp_rank * n, n)]
    if role in (Role.ROW, Role.EXPERT_ROW):
        k = shape[1] // tp
        return [Piece(names[0], 0, tp_rank * k, k, column=True)]
    if role is Role.VOCAB:
        keep = min(n, dims.vocab_size - tp_rank * n)
        return [Piece(names[0], 0, tp_rank * n, keep)] if keep > 0 else []
    if role in (Role.GATED_MLP, Role.EXPERT_GATED_MLP):
        half = n // 2  # local rows are [gate_r; up_r]
        return [Piece(names[0], 0, tp_rank * half, half), Piece(names[1], half, tp_rank * half, half)]
    if role is Role.QKV:
        d, groups = dims.head_dim, dims.num_query_groups
        hq = dims.num_attention_heads // groups
        out = []
        for j in range(groups // tp):
            g, base = tp_rank * (groups // tp) + j, j * (hq + 2) * d
            out += [Piece(names[0], base, g * hq * d, hq * d),
                    Piece(names[1], base + hq * d, g * d, d),
                    Piece(names[2], base + (hq + 1) * d, g * d, d)]
        return out
    raise NotImplementedError(f"role {role.value} has no layout yet")


def grouped_boxes(spec: ParamSpec, dims: ModelDims, layout: SourceLayout, tp_rank: int,
                  ) -> list[tuple[int, int, Box, Box]]:
    """Legacy GroupedMLP: ``(local expert j, HF name index k, box in the view, box in the HF
    tensor)``; every copy is transposed (the stored block is the HF slab transposed)::

        weight1 as [E_local, h, 2F_l]: expert j = [ gate_r^T | up_r^T ]   (h rows, F_l + F_l columns)
        weight2 as [E_local, F_l, h]:  expert j = down_r^T                 (down_r = down_proj[:, r*F_l:(r+1)*F_l])
    """
    e_local, a, b = view_shape(spec, dims, layout)  # type: ignore[misc]
    r = tp_rank if layout.etp > 1 else 0
    out = []
    for j in range(e_local):
        if spec.role is Role.GROUPED_EXPERT_FC1:
            h, f = a, b // 2
            hf_shape = (f * layout.etp, h)
            for k in range(2):  # gate, up
                out.append((j, k, Box((j, 0, k * f), (1, h, f)), Box.rows(hf_shape, r * f, f)))
        else:
            f, h = a, b
            out.append((j, 0, Box((j, 0, 0), (1, f, h)), Box((0, r * f), (h, f))))
    return out


def grouped_pieces(spec: ParamSpec, dims: ModelDims, layout: SourceLayout, tp_rank: int, ep_rank: int,
                   layer: int) -> list[tuple[str, Box, Box]]:
    """:func:`grouped_boxes` with the HF names of ``layer`` and ep rank ``ep_rank``'s experts."""
    e_local = view_shape(spec, dims, layout)[0]  # type: ignore[index]
    return [(spec.hf_names(layer, ep_rank * e_local + j)[k], sbox, dbox)
            for j, k, sbox, dbox in grouped_boxes(spec, dims, layout, tp_rank)]


def _boxes(p: Piece, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> tuple[Box, Box]:
    if p.column:
        return Box.full(src_shape), Box((0, p.dst_start), (dst_shape[0], p.length))
    return Box.rows(src_shape, p.src_start, p.length), Box.rows(dst_shape, p.dst_start, p.length)


def source_tensors(dims: ModelDims, layout: SourceLayout) -> dict[RankCoord, dict[str, SourceTensor]]:
    """Every Megatron parameter each rank holds under ``layout``, with local shapes.

    Names are as ``named_parameters()`` gives them on that rank: local layer
    index per pipeline stage, local expert index per expert-parallel rank
    (global expert = ``ep_rank * num_experts / ep + local``). Non-expert tensors
    are replicated over ``ep`` ranks.
    """
    dims.check_layout(layout.tp, layout.pp, layout.ep, layout.etp)
    rows = dims.spec.rows(dims.conditions(layout.pp), layout.layer_spec, layout.expert_layout)
    per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
    if layout.mtp_layers > dims.mtp_layers:
        raise LayoutError(f"the trainer has mtp_layers={layout.mtp_layers} but the HF config stores "
                          f"{dims.mtp_layers} (num_nextn_predict_layers): nowhere to put the MTP layers")
    out: dict[RankCoord, dict[str, SourceTensor]] = {}
    for rank in layout.ranks():
        first, last = rank.pp == 0, rank.pp == layout.pp - 1
        tensors: dict[str, SourceTensor] = {}
        for stage_part in (Stage.FIRST, Stage.LAYER, Stage.LAST, Stage.MTP):
            if (stage_part is Stage.FIRST and not first) or (stage_part in (Stage.LAST, Stage.MTP) and not last):
                continue
            part = [r for r in rows if r.stage is stage_part]
            if stage_part is Stage.LAYER:
                layers: range | list[None] = range(layout.stage_layers[rank.pp])
            elif stage_part is Stage.MTP:
                layers = range(layout.mtp_layers)
                if layout.mtp_layers and not first:  # the MTP block's kept-in-sync embedding copy
                    for row in (r for r in rows if r.stage is Stage.FIRST):
                        tensors[row.megatron_name()] = SourceTensor(dataclasses.replace(row, duplicate=True), None,
                                                                    local_shape(row, dims, layout))
            else:
                layers = [None]
            for local in layers:
                if local is None:
                    glob = None
                elif stage_part is Stage.MTP:
                    glob = dims.num_layers + local  # HF stores MTP layer i as layer num_layers + i
                else:
                    glob = layout.layer_offset(rank.pp) + local
                kind = None if glob is None else dims.layer_kind(glob)
                for row in part:
                    if row.layer_kind is not None and row.layer_kind != kind:
                        continue
                    shape = local_shape(row, dims, layout)
                    if row.per_expert:
                        for i in range(per_ep):
                            tensors[row.megatron_name(local, i)] = SourceTensor(row, glob, shape,
                                                                                rank.ep * per_ep + i)
                    else:
                        tensors[row.megatron_name(local)] = SourceTensor(row, glob, shape)
        out[rank] = tensors
    return out


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

    Built on columns (:mod:`megarefit.plan_export`): sources, targets and ops are
    tables whose names are formatted on demand (DeepSeek-V3 tp8 ep64, 642k source
    tensors and 360k ops: ~0.5 s planned and validated on 2 cores). Cached per
    ``(dims, layout, dtype, experts)``.

    Raises:
        LayoutError: tp/pp/ep do not fit the model.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    from megarefit.plan_columns import plan_threads
    from megarefit.plan_export import plan_export

    with plan_threads():
        return plan_export(dims, layout, dtype, experts)


@lru_cache(maxsize=64)
def plan_hf_to_megatron(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16") -> Plan:
    """Plan the import of full HF tensors into every rank's Megatron shards.

    The exact inverse of :func:`plan_megatron_to_hf`'s geometry: every replica
    (each TP rank, the tied copy on the last stage) is written, and vocab
    padding rows are declared ``zero_fill``. Cached per ``(dims, layout, dtype)``.
    """
    tensors = source_tensors(dims, layout)
    sources: dict[TensorRef, TensorMeta] = {}
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    for rank, ts in tensors.items():
        for name, t in ts.items():
            if t.spec.role.is_grouped:
                view, tdtype = view_shape(t.spec, dims, layout), t.spec.dtype or dtype
                hf_shape = hf_shapes(t.spec, dims, layout)[0]
                dst = TensorRef(rank, name)
                for hf_name, vbox, hbox in grouped_pieces(t.spec, dims, layout, rank.tp, rank.ep, t.layer):
                    src = TensorRef(None, hf_name)
                    sources.setdefault(src, TensorMeta(hf_shape, tdtype))
                    ops.append(make_op(src, hf_shape, hbox, dst, view, vbox, itemsize(tdtype), transpose=True,
                                       dst_view=True))
                targets[dst] = TensorMeta(view, tdtype, storage_shape=t.shape)  # type: ignore[arg-type]
                continue
            names, shapes = t.spec.hf_names(t.layer, t.expert), hf_shapes(t.spec, dims, layout)
            shape_of = dict(zip(names, shapes))
            tdtype = t.spec.dtype or dtype
            item = itemsize(tdtype)
            for hf_name, shape in shape_of.items():
                sources.setdefault(TensorRef(None, hf_name), TensorMeta(shape, tdtype))
            dst = TensorRef(rank, name)
            written = 0
            for p in pieces(t.spec, names, dims, layout, rank.tp):
                dbox, sbox = _boxes(p, t.shape, shape_of[p.hf_name])
                ops.append(make_op(TensorRef(None, p.hf_name), shape_of[p.hf_name], sbox, dst, t.shape, dbox, item))
                written += p.length
            zero = ()
            if t.spec.role is Role.VOCAB and written < t.shape[0]:
                zero = (Box.rows(t.shape, written, t.shape[0] - written),)
            targets[dst] = TensorMeta(t.shape, tdtype, zero)
    plan = Plan("hf_to_megatron", dims, layout, dtype, sources, targets, tuple(ops),
                digest_of("hf_to_megatron", dims.to_dict(), layout.to_dict(), dtype))
    validate_plan(plan)
    return plan


def check_ranks(layout: SourceLayout, ranks: Iterable[tuple[int, int, int]]) -> None:
    """Raise :class:`LayoutError` unless ``ranks`` holds every coordinate of ``layout``'s
    process grid (:meth:`SourceLayout.ranks`). Coordinates of the full ``tp x pp x ep``
    grid that Megatron does not form (``etp == 1 < tp``) are tolerated: callers drop them."""
    expected = set(layout.ranks())
    grid = {RankCoord(t, p, e) for t in range(layout.tp) for p in range(layout.pp) for e in range(layout.ep)}
    given = {RankCoord(*r) for r in ranks}
    missing, extra = sorted(expected - given), sorted(given - grid)
    if missing or extra:
        raise LayoutError(
            f"shards for tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.etp} must hold ranks "
            f"{[tuple(r) for r in sorted(expected)]}; "
            + (f"missing {[tuple(r) for r in missing]}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {[tuple(r) for r in extra]} (wrong tp/pp/ep?)" if extra else "")
        )


def resolve_layer_spec(dims: ModelDims, layout: SourceLayout,
                       names: Mapping[RankCoord, Iterable[str]]) -> SourceLayout:
    """Check provided Megatron names against the layout; return it with the detected layer
    spec (norm spelling) and expert layout.

    ``names`` must hold every rank of ``layout`` and, on each, exactly the
    parameters the spec table implies (either fused-norm spelling, not both).

    Raises:
        LayoutError: a rank is missing or not part of the layout.
        UnknownParameterError / AmbiguousParameterError: a name matches no / two rows.
        MissingParameterError / UnexpectedParameterError: names differ from the layout's,
            naming the tensor and rank.
    """
    check_ranks(layout, names)
    expected_ranks = set(layout.ranks())
    given = {RankCoord(*r): list(v) for r, v in names.items() if RankCoord(*r) in expected_ranks}
    spec, conds = dims.spec, dims.conditions(layout.pp)
    names_all = [(rank, n) for rank, ns in given.items() for n in ns]

    def fits(spelling: LayerSpec) -> bool:
        try:
            for rank, n in names_all:
                spec.match(n, conds, spelling, rank=rank)
        except UnknownParameterError:
            return False
        return True

    # The same name can mean different roles in the two layer specs (MLA down-projections:
    # column-parallel in the local spec, replicated in the TE spec): decide the spelling first.
    candidates = [s for s in LAYER_SPECS if fits(s)]
    if not candidates:
        for rank, n in names_all:
            spec.match(n, conds, rank=rank)  # raises UnknownParameterError for a truly unknown name
        examples = []
        for s in LAYER_SPECS:  # a name that only the *other* spelling explains
            for rank, n in names_all:
                try:
                    spec.match(n, conds, s, rank=rank)
                except UnknownParameterError:
                    other = "te" if s == "local" else "local"
                    examples.append(f"{n!r} on rank {rank} is {other}-spec")
                    break
        raise UnexpectedParameterError("shards mix local-spec and Transformer-Engine-spec names: "
                                       + "; ".join(examples))
    chosen: LayerSpec = layout.layer_spec if layout.layer_spec in candidates else candidates[0]
    expert_layouts: dict[str, str] = {}
    for rank, n in names_all:
        row = spec.match(n, conds, chosen, rank=rank).spec
        if row.expert_layout is not None:
            expert_layouts.setdefault(row.expert_layout, f"{n!r} on rank {rank}")
    if len(expert_layouts) > 1:
        raise UnexpectedParameterError("shards mix expert layouts: "
                                       + "; ".join(f"{where} is {lay}" for lay, where in sorted(expert_layouts.items())))
    resolved = layout.with_layer_spec(chosen)
    if expert_layouts:
        resolved = resolved.with_expert_layout(next(iter(expert_layouts)))
    expected = source_tensors(dims, resolved)
    for rank in sorted(expected_ranks):
        want, have = set(expected[rank]), set(given[rank])
        if want - have:
            first = sorted(want - have)
            raise MissingParameterError(
                f"rank {rank} lacks {len(first)} expected parameter(s), e.g. {first[:3]} "
                f"(layout tp={layout.tp} pp={layout.pp}: stage {rank.pp} holds layers "
                f"{layout.layer_offset(rank.pp)}..{layout.layer_offset(rank.pp) + layout.stage_layers[rank.pp] - 1})"
            )
        if have - want:
            first = sorted(have - want)
            raise UnexpectedParameterError(
                f"rank {rank} holds {len(first)} parameter(s) the layout does not place there, e.g. {first[:3]} "
                f"(stage {rank.pp} of pp={layout.pp} has {layout.stage_layers[rank.pp]} local layers)"
            )
    return resolved


__all__ = ["LAYER_SPECS", "Piece", "SourceTensor", "global_shape", "grouped_boxes", "hf_shapes", "local_shape", "pieces",
           "check_ranks", "plan_hf_to_megatron", "plan_megatron_to_hf", "resolve_layer_spec", "source_tensors"]
