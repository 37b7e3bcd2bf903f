"""Import planning: full HF tensors -> every rank's Megatron shards.

The exact inverse of the export's geometry (:mod:`megarefit.layout.geometry`): every
replica (each TP rank, the tied copy on the last stage) is written, and vocab padding
rows are declared ``zero_fill``.
"""

from __future__ import annotations

from functools import lru_cache

from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import (
    SourceTensor,
    fused_boxes,
    fused_shapes,
    grouped_pieces,
    hf_shapes,
    piece_boxes,
    pieces,
    source_tensors,
    view_shape,
)
from megarefit.layout.parallel import Box, SourceLayout
from megarefit.plan import (
    STAGING_SUFFIX,
    CopyOp,
    Plan,
    TensorMeta,
    TensorRef,
    ValueStep,
    digest_of,
    itemsize,
    make_op,
    validate_plan,
)
from megarefit.specs.table import Role

INVERSE_VALUE = {"plus_one": "minus_one"}
"""The value function an import applies for each export value rule (``ParamSpec.value``)."""


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
    steps: list[ValueStep] = []
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
            if t.spec.role.is_fused:
                _fused_ops(t, TensorRef(rank, name), dims, layout, dtype, rank.tp, sources, ops)
                targets[TensorRef(rank, name)] = TensorMeta(t.shape, t.spec.dtype or dtype)
                continue
            names, shapes = t.spec.hf_names(t.layer, t.expert), hf_shapes(t.spec, dims, layout)
            shape_of = dict(zip(names, shapes))
            tdtype = t.spec.dtype or dtype
            item = itemsize(tdtype)
            for hf_name, shape in shape_of.items():
                sources.setdefault(TensorRef(None, hf_name), TensorMeta(shape, tdtype))
            dst = TensorRef(rank, name + STAGING_SUFFIX if t.spec.value else name)
            written = 0
            for p in pieces(t.spec, names, dims, layout, rank.tp):
                dbox, sbox = piece_boxes(p, t.shape, shape_of[p.hf_name])
                ops.append(make_op(TensorRef(None, p.hf_name), shape_of[p.hf_name], sbox, dst, t.shape, dbox, item))
                written += p.length
            zero = ()
            if t.spec.role is Role.VOCAB and written < t.shape[0]:
                zero = (Box.rows(t.shape, written, t.shape[0] - written),)
            targets[dst] = TensorMeta(t.shape, tdtype, zero)
            if t.spec.value:  # the Megatron tensor from the staging one: the inverse of the export's value rule
                targets[TensorRef(rank, name)] = targets[dst]
                steps.append(ValueStep(dst, TensorRef(rank, name), INVERSE_VALUE[t.spec.value]))
    plan = Plan("hf_to_megatron", dims, layout, dtype, sources, targets, tuple(ops),
                digest_of("hf_to_megatron", dims.to_dict(), layout.to_dict(), dtype), transforms=tuple(steps))
    validate_plan(plan)
    return plan


def _fused_ops(t: SourceTensor, dst: TensorRef, dims: ModelDims, layout: SourceLayout, dtype: str, tp_rank: int,
               sources: dict[TensorRef, TensorMeta], ops: list[CopyOp]) -> None:
    """Ops filling expert ``t.expert``'s shard ``dst`` from its slot of a fused HF tensor
    (the export's :func:`fused_boxes` with the two sides swapped)."""
    view, stored = fused_shapes(t.spec, dims, layout, dims.num_experts)
    tdtype = t.spec.dtype or dtype
    src = TensorRef(None, t.spec.hf_names(t.layer)[0])
    sources.setdefault(src, TensorMeta(view, tdtype, storage_shape=None if view == stored else stored))
    for local_box, hf_box, tr in fused_boxes(t.spec, dims, layout, tp_rank):
        at = Box((t.expert,) + hf_box.offsets[1:], hf_box.lengths)  # type: ignore[operator]
        ops.append(make_op(src, view, at, dst, t.shape, local_box, itemsize(tdtype), transpose=tr,
                           src_view=view != stored))


__all__ = ["plan_hf_to_megatron"]
