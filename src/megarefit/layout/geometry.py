"""Shard geometry: where each row of a sharded Megatron tensor lands in the HF tensors.

Pure functions of a spec row, :class:`ModelDims` and a :class:`SourceLayout`: local and
global shapes, :class:`Piece` s (row runs of a local tensor in its HF tensors), the
legacy ``GroupedMLP`` boxes, and every tensor each rank holds (:func:`source_tensors`).
This is the one place that knows these layout facts; the planners build plans from them.

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

Rotated heads (a replicated row with ``head_rotate``, GLM-5's DSA indexer ``wq_b``, ``wk``,
``k_norm``); D rows per head, r = qk_rope_head_dim::

    Megatron head h [nope (D-r rows); rope (r rows)]  ->  HF head h [rope; nope]
    rows [h*D, h*D + D-r) -> HF rows [h*D + r, (h+1)*D);  rows [h*D + D-r, (h+1)*D) -> HF rows [h*D, h*D + r)

Vocab (``word_embeddings``, ``output_layer``): rows split over the *padded*
vocab; rows >= HF ``vocab_size`` are padding, trimmed on export and zero on
import. Row-parallel (``linear_proj``, ``linear_fc2``): rank r holds columns
``[r*n/tp, (r+1)*n/tp)``; each op is one contiguous source run landing strided
in the HF tensor, i.e. a scratch copy.
"""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from megarefit.errors import LayoutError
from megarefit.layout.dims import ModelDims
from megarefit.layout.parallel import Box, RankCoord, SourceLayout
from megarefit.specs.table import ParallelMode, ParamSpec, Role, Stage


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
def _fused_boxes_out_in(spec: ParamSpec, local: tuple[int, ...], r: int) -> list[tuple[Box, Box, bool]]:
    """:func:`fused_boxes` of a weight (2-D) into the ``out_in`` layout."""
    if spec.role is Role.EXPERT_GATE_UP_FUSED:
        f, h = local[0] // 2, local[1]
        return [(Box.rows(local, k * f, f), Box((0, r * f, k, 0), (1, f, 1, h)), False) for k in range(2)]
    if spec.role is Role.EXPERT_ROW_FUSED:
        h, f = local
        return [(Box.full(local), Box((0, 0, r * f), (1, h, f)), False)]
    return [(Box.full(local), Box((0, 0, 0), (1,) + local), False)]


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


def grouped_stored_shape(role: Role, view: tuple[int, int, int]) -> tuple[int, int]:
    """The 2-D shape legacy GroupedMLP stores its ``[E_local, a, b]`` view as (Megatron-Core's
    ``GroupedMLP``): ``weight1`` ``[h, E_local*2F/etp]``, ``weight2`` ``[E_local*F/etp, h]``;
    :func:`grouped_view_of` is its inverse."""
    e, a, b = view
    return (a, e * b) if role is Role.GROUPED_EXPERT_FC1 else (e * a, b)


def grouped_view_of(role: Role, stored: tuple[int, ...], experts: int) -> tuple[int, int, int] | None:
    """The ``[E_local, a, b]`` view of a legacy GroupedMLP tensor stored as ``stored`` with
    ``experts`` local experts (the inverse of :func:`grouped_stored_shape`); ``None`` for any
    other role, or a shape that does not divide into ``experts`` blocks."""
    if role is Role.GROUPED_EXPERT_FC1 and len(stored) == 2 and stored[1] % experts == 0:
        return (experts, stored[0], stored[1] // experts)
    if role is Role.GROUPED_EXPERT_FC2 and len(stored) == 2 and stored[0] % experts == 0:
        return (experts, stored[0] // experts, stored[1])
    return None


@lru_cache(maxsize=4096)
def local_shape(spec: ParamSpec, dims: ModelDims, layout: SourceLayout) -> tuple[int, ...]:
    if spec.role.is_grouped:
        return grouped_stored_shape(spec.role, view_shape(spec, dims, layout))  # type: ignore[arg-type]
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
    if spec.role in (Role.QKV, Role.GATED_QKV):
        q, kv = dims.num_attention_heads * dims.head_dim, dims.num_query_groups * dims.head_dim
        q *= 2 if spec.role is Role.GATED_QKV else 1  # q_proj holds each head's [q_h; gate_h]
        return ((q,) + rest, (kv,) + rest, (kv,) + rest)
    if spec.segment_hf:  # each HF tensor stacks its segments
        sizes = [dims.size(sym) for sym in spec.segments]
        return tuple((sum(n for n, k in zip(sizes, spec.segment_hf) if k == j),) + rest
                     for j in range(len(spec.hf)))
    if spec.role in (Role.GATED_MLP, Role.EXPERT_GATED_MLP):
        return ((shape[0] // 2,) + rest,) * 2
    if spec.role is Role.GROUPED_EXPERT_FC1:  # block [h, 2F] -> gate, up [F, h]
        return ((shape[1] // 2, shape[0]),) * 2
    if spec.role is Role.GROUPED_EXPERT_FC2:  # block [F, h] -> down [h, F]
        return ((shape[1], shape[0]),)
    if spec.role is Role.VOCAB:
        return ((dims.vocab_size,) + rest,)
    if spec.role.is_fused:
        return (fused_shapes(spec, dims, layout, dims.num_experts)[0],)
    if spec.pack is not None:  # one of ``parts`` equal dim-0 parts of the HF tensor
        return ((spec.pack[1] * shape[0],) + rest,)
    return (shape,)


ExpertWeights = Literal["in_out", "out_in"]
"""How a fused target stores each expert's weight: ``"in_out"`` as HF's gpt-oss (``x @ W``),
``"out_in"`` as Megatron and vLLM's FusedMoE (``w13_weight`` [E, 2f, h], rows interleaved
gate / up; ``w2_weight`` [E, h, f]), the pivot a vLLM worker's plan is re-targeted from."""


@lru_cache(maxsize=4096)
def fused_shapes(spec: ParamSpec, dims: ModelDims, layout: SourceLayout, experts: int,
                 weights: ExpertWeights = "in_out") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(view, stored shape)`` of a fused role's HF tensor holding ``experts`` experts (see
    :class:`~megarefit.specs.table.Role`): weights per expert ``[in, out]`` (or ``[out, in]``,
    ``weights="out_in"``), biases as they are; ``gate_up`` viewed with its interleave as a
    dim of 2::

        in_out: gate_up_proj [E, h, 2f] as [E, h, f, 2]    down_proj [E, f, h]
        out_in: gate_up_proj [E, 2f, h] as [E, f, 2, h]    down_proj [E, h, f]
        gate_up_proj_bias [E, 2f] as [E, f, 2]             down_proj_bias [E, h]
    """
    shape = global_shape(spec, dims, layout)
    per = shape[::-1] if len(shape) == 2 and weights == "in_out" else shape
    stored = (experts,) + per
    if spec.role is not Role.EXPERT_GATE_UP_FUSED:
        return stored, stored
    if len(shape) == 2 and weights == "out_in":
        return (experts, shape[0] // 2, 2, shape[1]), stored
    return stored[:-1] + (stored[-1] // 2, 2), stored


def fused_boxes(spec: ParamSpec, dims: ModelDims, layout: SourceLayout, tp_rank: int,
                weights: ExpertWeights = "in_out") -> list[tuple[Box, Box, bool]]:
    """A fused role's copies of one expert read on TP rank ``tp_rank``: ``(box in the local
    tensor, box in the HF view with the expert at 0 on dim 0, transposed)``; the planner
    moves the target box to the expert's slot. Two copies for ``gate_up`` (gate, up: one
    transposed box each, every ``f/etp x h`` element in one op), one otherwise::

        gate:  local rows [0, f_l)     -> view (e, 0, r*f_l, 0)  lengths (1, h, f_l, 1)   transposed
        up:    local rows [f_l, 2f_l)  -> view (e, 0, r*f_l, 1)  lengths (1, h, f_l, 1)   transposed
        (a bias: the same without the h dim, not transposed)
        down:  local [h, f_l]          -> (e, r*f_l, 0)          lengths (1, f_l, h)      transposed
        down bias: local [h]           -> (e, 0)                 lengths (1, h)

    With ``weights="out_in"`` nothing is transposed: gate / up rows land at
    ``(e, r*f_l, k, 0)`` lengths ``(1, f_l, 1, h)`` of ``[E, f, 2, h]``, down at ``(e, 0, r*f_l)``.
    """
    local = local_shape(spec, dims, layout)
    r = tp_rank if layout.etp > 1 else 0
    matrix = len(local) == 2
    if matrix and weights == "out_in":
        return _fused_boxes_out_in(spec, local, r)
    if spec.role is Role.EXPERT_GATE_UP_FUSED:
        f = local[0] // 2
        lead = ((0, 0), (1, local[1])) if matrix else ((0,), (1,))
        return [(Box.rows(local, k * f, f), Box(lead[0] + (r * f, k), lead[1] + (f, 1)), matrix) for k in range(2)]
    if spec.role is Role.EXPERT_ROW_FUSED:
        h, f = local
        return [(Box.full(local), Box((0, r * f, 0), (1, f, h)), True)]
    per = local[::-1] if matrix else local
    return [(Box.full(local), Box((0,) * (len(per) + 1), (1,) + per), matrix)]


def pieces(spec: ParamSpec, names: tuple[str, ...], dims: ModelDims, layout: SourceLayout, tp_rank: int) -> list[Piece]:
    """Where TP rank ``tp_rank``'s local tensor lands in the HF tensors ``names``
    (expert roles split over ``etp``; with ``etp == 1`` every TP rank holds whole experts)."""
    shape = global_shape(spec, dims, layout)
    tp, role = _split(spec, layout), spec.role
    tp_rank = tp_rank if tp > 1 else 0
    n = shape[0] // tp if role.parallel_mode is ParallelMode.COLUMN else shape[0]
    if role is Role.REPLICATED and spec.head_rotate is not None:
        head, rope = (dims.size(sym) for sym in spec.head_rotate)
        if not 0 < rope < head or shape[0] % head:
            raise LayoutError(f"{names[0]}: {shape[0]} rows are not whole heads of {head} rows with {rope} rotated")
        return [p for h in range(shape[0] // head)  # Megatron [nope; rope] -> HF [rope; nope], per head
                for p in (Piece(names[0], h * head + head - rope, h * head, rope),
                          Piece(names[0], h * head, h * head + rope, head - rope))]
    if role is Role.REPLICATED:
        return [Piece(names[0], 0, spec.pack[0] * shape[0] if spec.pack else 0, shape[0])]
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
    if role in (Role.QKV, Role.GATED_QKV):
        return _qkv_pieces(names, dims, n, tp_rank, gated=role is Role.GATED_QKV)
    if role in (Role.SEGMENTED, Role.EXPERT_COLUMN):
        return _segment_pieces(spec, names, dims, tp, tp_rank)
    raise NotImplementedError(f"role {role.value} has no layout yet")


def _qkv_pieces(names: tuple[str, ...], dims: ModelDims, n: int, tp_rank: int, gated: bool = False) -> list[Piece]:
    """QKV rows ``[tp_rank*n, (tp_rank+1)*n)`` of the global interleaved tensor (whole query groups
    when ``tp`` divides the groups; a part of one group's block when ``tp`` is a multiple of them, as
    Megatron-Core splits it then) cut at the runs of :func:`_qkv_runs`."""
    runs = _qkv_runs(dims, gated)
    block = sum(size for _, size, _, _ in runs)
    q_rows = dims.num_attention_heads // dims.num_query_groups * dims.head_dim * (2 if gated else 1)
    stride = (q_rows, dims.head_dim, dims.head_dim)  # HF rows of one group in q_proj, k_proj, v_proj
    lo, hi = tp_rank * n, (tp_rank + 1) * n
    out = []
    for g in range(lo // block, -(-hi // block)):
        for start, size, k, dst in runs:
            a, b = max(lo, g * block + start), min(hi, g * block + start + size)
            if a < b:
                out.append(Piece(names[k], a - lo, g * stride[k] + dst + a - g * block - start, b - a))
    return out


def _qkv_runs(dims: ModelDims, gated: bool) -> list[tuple[int, int, int, int]]:
    """One query group's block of ``linear_qkv`` as runs ``(start in the block, rows, HF name k, HF row
    of group 0)``; hq heads of d rows per group::

        plain:  [q (hq*d); k (d); v (d)]                       q -> q_proj rows [0, hq*d)
        gated:  [q_0 .. q_hq-1; gate_0 .. gate_hq-1; k; v]     q_j -> q_proj rows [2j*d, +d),
                (Megatron-Core ``attention_output_gate``)      gate_j -> [(2j+1)*d, +d) (HF: head j [q_j; gate_j])
    """
    d, hq = dims.head_dim, dims.num_attention_heads // dims.num_query_groups
    if not gated:
        return [(0, hq * d, 0, 0), (hq * d, d, 1, 0), ((hq + 1) * d, d, 2, 0)]
    heads = [(j * d, d, 0, 2 * j * d) for j in range(hq)] + [((hq + j) * d, d, 0, (2 * j + 1) * d) for j in range(hq)]
    return heads + [(2 * hq * d, d, 1, 0), ((2 * hq + 1) * d, d, 2, 0)]


def _segment_pieces(spec: ParamSpec, names: tuple[str, ...], dims: ModelDims, tp: int, tp_rank: int) -> list[Piece]:
    """A segmented row (Mamba's ``in_proj`` [z; x; B; C; dt], ``conv1d`` [x; B; C]): each segment
    split over ``tp``, rank r holding ``[seg0_r; seg1_r; ...]``, each landing in HF tensor
    ``segment_hf`` names (after the earlier segments there); an expert column row is one segment."""
    sizes = [dims.size(sym) for sym in (spec.segments or spec.shape[:1])]
    where = spec.segment_hf or (0,) * len(sizes)
    if spec.segment_groups is not None:
        return _grouped_segment_pieces(names, sizes, where, dims.size(spec.segment_groups), tp, tp_rank)
    out, src, dst = [], 0, [0] * len(names)
    for size, k in zip(sizes, where):
        if size % tp:
            raise LayoutError(f"{names[k]}: a segment of {size} rows does not split over tp={tp}")
        local = size // tp
        out.append(Piece(names[k], src, dst[k] + tp_rank * local, local))
        src, dst[k] = src + local, dst[k] + size
    return out


def _grouped_segment_pieces(names: tuple[str, ...], sizes: list[int], where: tuple[int, ...], groups: int, tp: int,
                            tp_rank: int) -> list[Piece]:
    """Segments of HF tensors packed per group (Qwen3-Next's ``in_proj_qkvz``: key head g holds
    [q_g; k_g; v_g; z_g]): rank r's segment s is groups ``[r*G/tp, (r+1)*G/tp)`` of it, and group g's
    part of s sits in its HF tensor at ``g * block + (the group's parts of the earlier segments there)``."""
    if groups % tp or any(size % groups for size in sizes):
        raise LayoutError(f"{names[0]}: {groups} groups of segments {sizes} do not split over tp={tp}")
    block = [sum(size // groups for size, k in zip(sizes, where) if k == j) for j in range(len(names))]
    out, src, offset = [], 0, [0] * len(names)
    for size, k in zip(sizes, where):
        part = size // groups
        for g in range(tp_rank * groups // tp, (tp_rank + 1) * groups // tp):
            out.append(Piece(names[k], src, g * block[k] + offset[k], part))
            src += part
        offset[k] += part
    return out


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


def piece_boxes(p: Piece, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> tuple[Box, Box]:
    """``(box in the local tensor, box in the HF tensor)`` of piece ``p`` (for the export direction;
    the import swaps them)."""
    if p.column:
        return Box.full(src_shape), Box((0, p.dst_start), (dst_shape[0], p.length))
    return Box.rows(src_shape, p.src_start, p.length), Box.rows(dst_shape, p.dst_start, p.length)


def check_source(dims: ModelDims, layout: SourceLayout) -> tuple[ParamSpec, ...]:
    """The spec-table rows the trainer's ranks hold, once ``layout`` is checked against the model.

    Raises:
        LayoutError: tp/pp/ep/etp or the expert layout do not fit the model; more MTP layers
            trained than the HF config stores.
        UnverifiedMegatronError: the trainer's Megatron-Core version, or a config flag that
            matters for this model, is one megarefit has not verified (see
            :meth:`~megarefit.specs.megatron_core.MegatronCore.check`).
    """
    dims.check_layout(layout.tp, layout.pp, layout.ep, layout.etp)
    layout.megatron.check(dims.megatron_needs(layout.mtp_layers), expert_layout=layout.expert_layout,
                          model=dims.family)
    dims.check_expert_layout(layout.expert_layout)
    if layout.mtp_layers > dims.mtp_layers:
        raise LayoutError(f"the trainer has mtp_layers={layout.mtp_layers} but the HF config stores "
                          f"{dims.mtp_layers} (num_nextn_predict_layers): nowhere to put the MTP layers")
    return dims.spec.rows(dims.conditions(layout.pp, layout.megatron), layout.layer_spec, layout.expert_layout)


def source_tensors(dims: ModelDims, layout: SourceLayout) -> dict[RankCoord, dict[str, SourceTensor]]:
    """Every Megatron parameter each rank holds under ``layout``, with local shapes.

    Names are as ``named_parameters()`` gives them on that rank: local layer
    index per pipeline stage, local expert index per expert-parallel rank
    (global expert = ``ep_rank * num_experts / ep + local``). Non-expert tensors
    are replicated over ``ep`` ranks.
    """
    rows = check_source(dims, layout)
    per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
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
                for row in part:
                    if not dims.has_row(row, glob):
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


__all__ = ["ExpertWeights", "Piece", "SourceTensor", "fused_boxes", "fused_shapes", "global_shape", "grouped_boxes",
           "grouped_pieces", "grouped_stored_shape", "grouped_view_of", "hf_shapes", "local_shape", "piece_boxes", "pieces", "source_tensors", "view_shape"]
