"""Block-FP8 plans: where each quantized weight is quantized, and the ops that move it.

:func:`plan_fp8` turns a Megatron -> HF plan into one whose quantized weights arrive as
``weight`` (float8_e4m3fn) + ``weight_scale_inv`` (float32). A trainer quantizes its
own shard on the shard's *local* block grid; that equals the HF tensor's *global* grid
exactly when every piece of the shard starts on a block boundary in both tensors and
spans whole blocks (or ends where both tensors end)::

    HF q_proj rows      0        128       256       384
                        |  blk 0  |  blk 1  |  blk 2  |          q rows per rank = 256:
    rank 0 shard rows   0        128      256                    each piece starts on the
    rank 1 shard rows                     0        128      256  grid -> trainer-side
                                                                 q rows per rank = 192:
    rank 1 shard rows                0 (HF row 192)              HF block 1 straddles
                                                                 ranks 0 and 1 -> receiver

Then the trainer serves the shard as FP8 under its own name plus ``<name>_scale_inv``
(float32 ``[ceil(rows/128), ceil(cols/128)]``), and each op moves FP8 bytes (half of
bf16) while a matching op moves the scale rows / columns (the same boxes divided by the
block: a column-parallel shard's scale rows are contiguous, a row-parallel shard's
scale columns strided). Where a block would straddle shards (or the source is a
transposed legacy GroupedMLP block), the plan pulls the model dtype into a staging
target and a :class:`~megarefit.plan.QuantizeStep` quantizes it on the receiver; the
step's ``reason`` names the tensor, rank, dim and offsets. Both paths are bit-identical
to vLLM's ``per_block_cast_to_fp8`` of the full HF tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarefit.layout import RankCoord
from megarefit.plan import STAGING_SUFFIX, CopyOp, Plan, QuantizeStep, TensorMeta, TensorRef, digest_of, make_op, validate_plan
from megarefit.plan.columns import plan_threads
from megarefit.plan.table import OpTable
from megarefit.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Format, UnsupportedQuantizationError, quantize_fp8
from megarefit.quant.fp8_columns import plan_fp8_columns
from megarefit.quant.grid import misaligned, scale_box
from megarefit.quant.scheme import quantized_weight_names



def scale_ref(ref: TensorRef) -> TensorRef:
    """The scale tensor of an FP8 tensor: ``name`` -> ``name_scale_inv`` (trainer shards and HF
    weights alike: ``...linear_qkv.weight_scale_inv``, ``...q_proj.weight_scale_inv``)."""
    return TensorRef(ref.rank, ref.name + SCALE_SUFFIX)


_CACHE: dict[tuple[str, Fp8Format], Plan] = {}


def plan_fp8(plan: Plan, fmt: Fp8Format) -> Plan:
    """``plan`` (Megatron -> HF or -> vLLM) with every quantized weight (see
    :func:`~megarefit.quant.quantized_weight_names`) delivered as block FP8.

    Trainer-side where the blocks allow (the sources become float8_e4m3fn shards plus
    ``<name>_scale_inv`` sources); receiver-side otherwise (a staging target and a
    :class:`QuantizeStep`). Cached per (plan digest, format).

    Raises:
        UnsupportedQuantizationError: a family vLLM does not serve in block FP8 (gpt-oss).
        PlanValidationError: internal inconsistency (a bug).
    """
    cached = _CACHE.get((plan.digest, fmt))
    if cached is not None:
        return cached
    if plan.dims.num_experts and any(r.role.is_fused for r in plan.dims.spec.entries):
        raise UnsupportedQuantizationError(
            f"{plan.dims.family}: block FP8 is not produced for it (vLLM serves gpt-oss in bf16 or MXFP4, and "
            "reads no block-FP8 experts for it); refit the model dtype (quantization='none', CLI --quantization none)")
    if plan.dims.layer_pattern:
        raise UnsupportedQuantizationError(
            f"{plan.dims.family}: block FP8 is not produced for hybrid Mamba models yet; refit the model dtype "
            "(quantization='none', CLI --quantization none)")
    if isinstance(plan.ops, OpTable):  # a columnar plan (plan_megatron_to_hf): the same rules on columns
        with plan_threads():
            out = plan_fp8_columns(plan, fmt, STAGING_SUFFIX)
    else:
        out = _plan_fp8_ops(plan, fmt)
    if len(_CACHE) >= 64:
        _CACHE.clear()
    _CACHE[(plan.digest, fmt)] = out
    return out


def _plan_fp8_ops(plan: Plan, fmt: Fp8Format) -> Plan:
    """:func:`plan_fp8` op by op (plans built as objects: vLLM targets, JSON)."""
    by_target = plan.ops_by_target
    trainer, quantized, reasons = _where_to_quantize(plan, fmt)
    sources = _fp8_source_metas(plan, fmt, {op.src for t in trainer for op in by_target[t]})
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    steps: list[QuantizeStep] = []
    for ref, meta in plan.targets.items():
        if ref in trainer:
            sref, sshape = scale_ref(ref), fmt.scale_shape(meta.shape)
            targets[ref] = TensorMeta(meta.shape, "float8_e4m3fn")
            targets[sref] = TensorMeta(sshape, "float32")
            for op in by_target[ref]:  # same boxes, shapes and kind: one byte per element now
                ops.append(CopyOp(op.src, op.src_box, ref, op.dst_box, op.kind, op.src_offset, op.dst_offset, 1,
                                  op.transpose, op.src_view, op.dst_view))
            for op in by_target[ref]:
                src_scale = scale_ref(op.src)
                ops.append(make_op(src_scale, sources[src_scale].shape, scale_box(op.src_box, fmt), sref, sshape,
                                   scale_box(op.dst_box, fmt), 4))
        elif ref in quantized:
            staging = TensorRef(None, ref.name + STAGING_SUFFIX)
            targets[staging] = meta
            targets[ref] = TensorMeta(meta.shape, "float8_e4m3fn")
            targets[scale_ref(ref)] = TensorMeta(fmt.scale_shape(meta.shape), "float32")
            for op in by_target[ref]:
                ops.append(make_op(op.src, sources[op.src].shape, op.src_box, staging, meta.shape, op.dst_box,
                                   op.itemsize, transpose=op.transpose, src_view=op.src_view is not None))
            why = next(reasons[op.src] for op in by_target[ref] if op.src in reasons)
            steps.append(QuantizeStep(staging, ref, scale_ref(ref), fmt.block, fmt.ue8m0, why))
        else:
            targets[ref] = meta
            ops.extend(by_target[ref])
    out = Plan(plan.direction, plan.dims, plan.layout, plan.dtype, sources, targets, tuple(ops),
               digest_of("fp8", plan.digest, list(fmt.block), fmt.ue8m0), tuple(steps), plan.transforms)
    validate_plan(out)
    return out


def _where_to_quantize(plan: Plan, fmt: Fp8Format
                       ) -> tuple[set[TensorRef], list[TensorRef], dict[TensorRef, str]]:
    """``(trainer-quantized targets, every quantized target, source -> why it cannot be
    quantized where it lives)``: a target is quantized on the trainers when every op writing it
    is block-aligned and none of its sources also feeds a receiver-quantized or an unquantized target."""
    names = quantized_weight_names(plan.dims)
    by_target = plan.ops_by_target
    quantized = [t for t in plan.targets if t.name in names]
    reasons: dict[TensorRef, str] = {}  # source -> why it cannot be quantized where it lives
    for t in plan.targets:  # a source that also feeds an unquantized tensor (gated DeltaNet's in_proj b / a rows)
        if t.name not in names:
            for op in by_target[t]:
                reasons.setdefault(op.src, f"{op.src.name} on rank {op.src.rank} also feeds a tensor kept in the "
                                           "model dtype or quantized on the receiver")
    for t in quantized:
        for op in by_target[t]:
            why = misaligned(op, plan.sources[op.src].shape, plan.targets[t].shape, fmt)
            if why is not None:
                reasons.setdefault(op.src, why)
    trainer = {t for t in quantized if not any(op.src in reasons for op in by_target[t])}
    while True:  # a source some receiver-side target reads must stay in the model dtype
        bf16 = {op.src for t in quantized if t not in trainer for op in by_target[t]}
        moved = {t for t in trainer if any(op.src in bf16 for op in by_target[t])}
        if not moved:
            break
        for t in moved:
            src = next(op.src for op in by_target[t] if op.src in bf16)
            reasons.setdefault(src, f"{src.name} on rank {src.rank} also feeds a tensor kept in the model dtype or "
                                    "quantized on the receiver")
        trainer -= moved
    return trainer, quantized, reasons


def _fp8_source_metas(plan: Plan, fmt: Fp8Format, fp8: set[TensorRef]) -> dict[TensorRef, TensorMeta]:
    """``plan``'s sources with each of ``fp8`` served as float8_e4m3fn plus its float32 ``_scale_inv``."""
    sources: dict[TensorRef, TensorMeta] = {}
    for ref, meta in plan.sources.items():
        if ref in fp8:
            sources[ref] = TensorMeta(meta.shape, "float8_e4m3fn")
            sources[scale_ref(ref)] = TensorMeta(fmt.scale_shape(meta.shape), "float32")
        else:
            sources[ref] = meta
    return sources


def fp8_sources(plan: Plan, rank: RankCoord) -> list[TensorRef]:
    """The sources ``rank`` serves as FP8 under ``plan`` (each with a ``_scale_inv`` source)."""
    return [ref for ref, meta in plan.sources.items()
            if ref.rank == rank and meta.dtype == "float8_e4m3fn"]


@torch.no_grad()
def quantize_shard(tensor: torch.Tensor, fmt: Fp8Format, out: torch.Tensor | None = None,
                   scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A trainer's shard on its local block grid (what a Publisher serves for an FP8 source)."""
    return quantize_fp8(tensor, fmt, out=out, scale_out=scale_out)


def quantize_sources(plan: Plan, tensors: Mapping[RankCoord | None, Mapping[str, torch.Tensor]], fmt: Fp8Format
                     ) -> dict[RankCoord | None, dict[str, torch.Tensor]]:
    """What the trainers serve under an FP8 ``plan``: ``tensors`` with every FP8 source
    replaced by its block-FP8 shard and its ``_scale_inv`` added (new dicts; the inputs
    are not modified). In-process equivalent of the Publisher's quantization."""
    out = {rank: dict(params) for rank, params in tensors.items()}
    for ref, meta in plan.sources.items():
        if meta.dtype == "float8_e4m3fn" and not ref.name.endswith(SCALE_SUFFIX):
            out[ref.rank][ref.name], out[ref.rank][scale_ref(ref).name] = quantize_shard(out[ref.rank][ref.name], fmt)
    return out


def where_quantized(plan: Plan) -> dict[str, str]:
    """HF weight name -> ``"trainer"`` or ``"receiver: <reason>"`` for every FP8 target."""
    out = {q.weight.name: f"receiver: {q.reason}" for q in plan.quantize}
    for ref, meta in plan.targets.items():
        if meta.dtype == "float8_e4m3fn" and ref.name not in out:
            out[ref.name] = "trainer"
    return out


def fp8_weight_count(plan: Plan) -> int:
    """Number of FP8 weight targets of ``plan`` (``len(where_quantized(plan))``: a receiver
    quantize step's weight is an FP8 target too), counted on the target table's columns
    without formatting a name (a 1.1M-op Kimi-K2 plan: ms, not 0.6 s)."""
    targets, fp8 = plan.targets, str(FP8_DTYPE).removeprefix("torch.")
    groups = getattr(targets, "groups", None)
    if groups is None:  # a plain mapping (a plan read back from JSON)
        return sum(1 for meta in targets.values() if meta.dtype == fp8)
    per_group = torch.bincount(targets.group, minlength=len(groups)).tolist()
    return sum(n for g, n in zip(groups, per_group) if g.meta.dtype == fp8)


__all__ = ["FP8_DTYPE", "SCALE_SUFFIX", "STAGING_SUFFIX", "fp8_sources", "fp8_weight_count", "plan_fp8",
           "quantize_shard", "quantize_sources", "scale_ref", "where_quantized"]
