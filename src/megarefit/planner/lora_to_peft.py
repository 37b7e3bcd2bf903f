"""Adapter planning: Megatron-Bridge LoRA adapter shards -> full HF PEFT adapter tensors.

A LoRA trainer's adapters (:mod:`megarefit.specs.lora`) are planned like any export: every
PEFT tensor (``base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight`` ...) is a target,
every TP rank's adapter shard a source, each op a box of one into a box of the other::

    role of the shard                 shard on tp rank t        lands in the PEFT tensor
    row (A of linear_proj / fc2)      [r, in/tp]                columns [t*in/tp, (t+1)*in/tp) of [r, in]
    column, A (of linear_qkv / fc1)   [r/tp, hidden]            rows [t*r/tp, ...) of each part's lora_A
                                                                (LoRA's one A: q, k and v each get it)
    column, B (of a row base; a       [out/tp, r]               rows [t*out/tp, ...) of [out, r]
      CanonicalLoRA projection)
    qkv / gated_mlp (fused B)         [out/tp, r], the base's   per query group q / k / v rows (gate, up):
                                      local row order           rows of each part's lora_B (layout.lora)

The geometry is :func:`~megarefit.layout.lora.part_runs`, the same rows Bridge's
``export_adapter_weights`` gathers; :func:`~megarefit.translate_peft.lora_to_peft` assembles the
same tensors by concatenation (an independent path the tests compare against). Layer numbers are
global: a stage's local layer ``l`` is layer ``sum(stage_layers[:stage]) + l``. Adapters are read
from the first data-parallel copy of each rank (a few MB: there is nothing to spread).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from megarefit.errors import LayoutError
from megarefit.layout.dims import ModelDims
from megarefit.layout.lora import adapter_global_shape, adapter_local_shape, part_runs
from megarefit.layout.parallel import Box, RankCoord, SourceLayout
from megarefit.plan import Plan, TensorMeta, TensorRef, digest_of, itemsize, make_op, validate_plan
from megarefit.plan.ops import CopyOp
from megarefit.specs.lora import AdapterRow, Factor, peft_row
from megarefit.specs.table import Role

PEFT_PREFIX = "base_model.model."
_SUFFIX = {Factor.A: ".lora_A.weight", Factor.B: ".lora_B.weight"}


def peft_names(row: AdapterRow, layer: int) -> tuple[str, ...]:
    """The PEFT tensor names adapter ``row`` of (global) ``layer`` becomes, one per base part."""
    return tuple(PEFT_PREFIX + m.format(layer=layer) + _SUFFIX[row.factor] for m in row.peft_modules())


def peft_config(names: Iterable[str], r: int, alpha: float) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` essentials of an adapter with PEFT tensor ``names``: ``peft_type``, ``r``,
    ``lora_alpha`` and ``target_modules`` (the adapted HF module kinds, sorted: ``q_proj``, ...)."""
    modules = sorted({n.split(".")[-3] for n in names})  # ...self_attn.q_proj.lora_A.weight -> q_proj
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules}


def part_shapes(row: AdapterRow, dims: ModelDims, r: int, tp: int) -> tuple[tuple[int, int], ...]:
    """Global shape of each PEFT tensor ``row`` becomes (``peft_names`` order)."""
    if row.role in (Role.QKV, Role.GATED_MLP):
        runs = part_runs(row, dims, tp)
        return tuple((tp * sum(x.length for x in runs if x.part == p), r) for p in range(len(row.parts)))
    return (adapter_global_shape(row, dims, r),) * len(row.parts)


def adapter_rows(names: Sequence[str]) -> tuple[AdapterRow, ...]:
    """The adapter rows one layer's adapter parameter ``names`` carry, in table order, checked to be the
    same for every layer of the stage (Bridge wraps the same ``target_modules`` on every layer).

    Raises:
        LayoutError: layers carry different adapters (names the layers and rows).
        UnsupportedAdapterError / UnknownParameterError: as :func:`~megarefit.specs.lora.peft_row`.
    """
    per_layer: dict[int, set[str]] = {}
    rows: dict[str, AdapterRow] = {}
    for name in names:
        row, layer = peft_row(name)
        per_layer.setdefault(layer, set()).add(row.megatron)
        rows[row.megatron] = row
    kinds = {frozenset(v) for v in per_layer.values()}
    if len(kinds) > 1:
        raise LayoutError(f"layers carry different adapters: {sorted(per_layer.items())[:4]} ...; megarefit plans "
                          "one set of wrapped linears for every layer (Bridge's target_modules, no per-layer excludes)")
    return tuple(rows[p] for p in sorted(rows, key=list(rows).index))


def _ops(row: AdapterRow, src: TensorRef, local: tuple[int, int], t: int, tp: int, dims: ModelDims,
         targets: list[tuple[TensorRef, tuple[int, int]]], item: int) -> list[CopyOp]:
    """The ops of one adapter shard (tp rank ``t``) into its PEFT ``targets`` (one per part)."""
    whole = Box.full(local)
    if row.role is Role.ROW:  # A of a row base: a column slab of [r, in]
        (dst, shape), = targets
        return [make_op(src, local, whole, dst, shape, Box((0, t * local[1]), local), item)]
    if row.role in (Role.QKV, Role.GATED_MLP):  # fused B: per query group (gate / up) runs
        ops = []
        for run in part_runs(row, dims, tp):
            dst, shape = targets[run.part]
            start = t * (shape[0] // tp) + run.part_start
            ops.append(make_op(src, local, Box.rows(local, run.base_start, run.length), dst, shape,
                               Box.rows(shape, start, run.length), item))
        return ops
    return [make_op(src, local, whole, dst, shape, Box.rows(shape, t * local[0], local[0]), item)
            for dst, shape in targets]  # column: LoRA's one A goes into each part's lora_A


def plan_lora_to_peft(dims: ModelDims, layout: SourceLayout, dtype: str, r: int,
                      rows: Sequence[AdapterRow]) -> Plan:
    """The plan pulling every adapter shard of ``rows`` (wrapped on every layer) into PEFT tensors.

    Args:
        dims, layout: the base model's (``layout.tp`` splits the adapters, ``stage_layers`` numbers them).
        dtype: the adapters' dtype (every source and target).
        r: the adapter rank (LoRA's ``dim``), divisible by ``tp`` where a row splits over r.
        rows: the adapter rows of one layer (:func:`adapter_rows`).

    Raises:
        LayoutError: ``r`` or a dim does not split over ``layout.tp``; experts are split (``ep > 1``: expert
            adapters are refused, and a dense layer's adapters are on every EP rank).
    """
    if layout.ep != 1:
        raise LayoutError(f"adapter plans are for ep=1 trainers, got ep={layout.ep} (expert adapters are refused)")
    tp, item = layout.tp, itemsize(dtype)
    sources: dict[TensorRef, TensorMeta] = {}
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    first = 0
    for stage, n_layers in enumerate(layout.stage_layers):
        for local_layer in range(n_layers):
            layer = first + local_layer
            for row in rows:
                refs = [TensorRef(None, n) for n in peft_names(row, layer)]
                shapes = part_shapes(row, dims, r, tp)
                for ref, shape in zip(refs, shapes, strict=True):
                    targets[ref] = TensorMeta(shape, dtype)
                name = row.megatron.format(layer=local_layer)
                local = adapter_local_shape(row, dims, r, tp, name=name)
                for t in range(tp):
                    src = TensorRef(RankCoord(t, stage, 0), name)
                    sources[src] = TensorMeta(local, dtype)
                    ops += _ops(row, src, local, t, tp, dims, list(zip(refs, shapes)), item)
        first += n_layers
    order = {ref: i for i, ref in enumerate(targets)}
    ops.sort(key=lambda op: (order[op.dst], op.dst_offset))
    digest = digest_of("lora_to_peft", dims.to_dict(), layout.to_dict(), dtype, r, [row.megatron for row in rows])
    plan = Plan("megatron_to_hf", dims, layout, dtype, sources, targets, tuple(ops), digest)
    validate_plan(plan)
    return plan


__all__ = ["PEFT_PREFIX", "adapter_rows", "part_shapes", "peft_config", "peft_names", "plan_lora_to_peft"]
