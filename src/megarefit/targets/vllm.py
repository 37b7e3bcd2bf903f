"""Plan Megatron shards straight into one vLLM worker's own parameter shards.

:func:`plan_megatron_to_vllm` re-targets the Megatron -> HF plan through the
worker's :class:`~megarefit.targets.vllm_layout.VllmPiece` s: every op's HF box is
intersected with each piece and moved to the piece's place in the vLLM parameter,
so bytes still move once, from the trainer shard to their final place (a worker
pulls 1/T of the dense bytes and only its experts). Under vLLM expert parallelism
the HF plan is built for the worker's experts only. The result is validated (exact
cover, zero-filled vocab padding) like any plan.

Legacy ``GroupedMLP`` sources stay transposed copies (``transpose``): a sub-box of the
HF tensor maps back to the transposed sub-box of the stored expert block::

    source view [E_l, h, 2F_l] box (j, h0.., f0..)  --transpose-->  HF gate rows f0.., cols h0..
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from megarefit.errors import LayoutError, UnsupportedModelError
from megarefit.layout import Box, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.plan import VALUE_DTYPES, Plan, QuantizeStep, TensorRef, ValueStep, digest_of
from megarefit.plan.columns import plan_threads
from megarefit.planner import plan_megatron_to_hf
from megarefit.quant.fp8 import Fp8Format, UnsupportedQuantizationError
from megarefit.quant.planning import SCALE_SUFFIX, STAGING_SUFFIX, plan_fp8
from megarefit.quant.scheme import quantized_weight_names
from megarefit.targets.vllm_columns import retarget
from megarefit.targets.vllm_layout import VllmParam, VllmPiece, VllmTarget, vllm_params


def _scale_box(box: Box, shape: tuple[int, ...], fmt: Fp8Format, what: str) -> Box:
    """``box`` (last two dims on the 128-block grid of ``shape``) in block units; leading
    dims (expert slots) unchanged.

    Raises:
        LayoutError: the box is off the grid (vLLM's block-FP8 layers need every rank's and
            every stacked part's rows / columns to be multiples of the block).
    """
    lead = len(box.offsets) - 2
    offsets, lengths = list(box.offsets[:lead]), list(box.lengths[:lead])
    for d, b in zip(range(lead, lead + 2), fmt.block):
        o, n, size = box.offsets[d], box.lengths[d], shape[d]
        if not fmt.on_grid(d - lead, o, n, size):
            raise LayoutError(f"{what}: {'rows' if d == lead else 'columns'} [{o}, {o + n}) are off the {b}-element "
                              "FP8 block grid (vLLM's block-FP8 layers need per-rank sizes divisible by the block)")
        offsets.append(o // b)
        lengths.append(-(-n // b))
    return Box(tuple(offsets), tuple(lengths))


def _scale_shape(shape: tuple[int, ...], fmt: Fp8Format) -> tuple[int, ...]:
    return tuple(shape[:-2]) + fmt.scale_shape(tuple(shape[-2:]))


def _fp8_params(params: dict[str, VllmParam], hf_plan: Plan, fmt: Fp8Format
                ) -> tuple[dict[str, tuple[VllmParam, str | None]], list[QuantizeStep]]:
    """The worker's parameters under block FP8: each quantized weight with its
    ``weight_scale_inv`` (pieces: the weight's boxes in block units, from the HF scales),
    filled by the trainers' FP8 shards; or, where the HF plan quantizes on the receiver, a
    staging parameter in the model dtype plus a :class:`QuantizeStep` on the worker's own
    block grid (equal to the HF grid: vLLM keeps every part block-aligned)."""
    quantized = quantized_weight_names(hf_plan.dims)
    receiver = {q.weight.name for q in hf_plan.quantize}
    out: dict[str, tuple[VllmParam, str | None]] = {}
    steps: list[QuantizeStep] = []
    for name, param in params.items():
        hf_names = {p.hf_name for p in param.pieces}
        if not hf_names & quantized:
            out[name] = (param, None)
            continue
        if not hf_names <= quantized or (hf_names & receiver and not hf_names <= receiver):
            raise UnsupportedQuantizationError(f"vLLM parameter {name}: its parts are quantized in different places")
        scale_pieces = tuple(VllmPiece(p.hf_name + SCALE_SUFFIX, _scale_box(p.hf_box, hf_plan.targets[
            TensorRef(None, p.hf_name)].shape, fmt, f"{p.hf_name}"), _scale_box(p.param_box, param.shape, fmt, name))
            for p in param.pieces)
        scale = name + SCALE_SUFFIX
        if hf_names & receiver:  # pull the model dtype into staging, quantize the worker's shard here
            staging = name + STAGING_SUFFIX
            out[staging] = (VllmParam(param.shape, tuple(dataclasses.replace(p, hf_name=p.hf_name + STAGING_SUFFIX)
                                                         for p in param.pieces)), None)
            out[name] = (VllmParam(param.shape, ()), "float8_e4m3fn")
            out[scale] = (VllmParam(_scale_shape(param.shape, fmt), ()), "float32")
            why = next(q.reason for q in hf_plan.quantize if q.weight.name in hf_names)
            steps.append(QuantizeStep(TensorRef(None, staging), TensorRef(None, name), TensorRef(None, scale),
                                      fmt.block, fmt.ue8m0, why))
        else:
            out[name] = (param, "float8_e4m3fn")
            out[scale] = (VllmParam(_scale_shape(param.shape, fmt), scale_pieces), "float32")
    return out, steps


def worker_experts(dims: ModelDims, target: VllmTarget) -> frozenset[int] | None:
    """The routed experts worker ``target`` holds under vLLM expert parallelism (``None``:
    every expert's slice, no EP) -- the expert set its HF plan is built for."""
    return frozenset(target.local_experts(dims.num_experts)) if dims.num_experts and target.ep_size > 1 else None


def _value_params(typed: dict[str, tuple[VllmParam, str | None]], hf_plan: Plan
                  ) -> tuple[dict[str, tuple[VllmParam, str | None]], list[ValueStep]]:
    """Parameters that are not a copy of trainer bytes, as a staging parameter the pulls fill (model
    dtype) and the parameter a :class:`ValueStep` makes from it (staging first: a receiver finishes
    targets in order): those vLLM stores transformed (``VllmParam.value_fn``: Mamba's ``A``, a float32
    ``A_log``), and those made of HF tensors the HF plan itself makes by a value step (a gated norm's
    ``w`` from Megatron's ``w - 1``): these read the HF plan's staging and take its function.

    Raises:
        UnsupportedModelError: a parameter mixes value-stepped HF tensors with others, or with a
            transform of its own.
    """
    made = {t.target.name: t.fn for t in hf_plan.transforms}
    out: dict[str, tuple[VllmParam, str | None]] = {}
    steps: list[ValueStep] = []
    for name, (param, dtype) in typed.items():
        fn, pieces = param.value_fn, param.pieces
        reads = {p.hf_name for p in pieces}
        if reads & made.keys():
            fns = {made.get(n) for n in reads}
            if len(fns) != 1 or fn is not None:
                raise UnsupportedModelError(f"vLLM parameter {name}: its HF parts are made by different value steps")
            fn = fns.pop()
            pieces = tuple(dataclasses.replace(p, hf_name=p.hf_name + STAGING_SUFFIX) for p in pieces)
        if fn is None:
            out[name] = (param, dtype)
            continue
        staging = name + STAGING_SUFFIX
        out[staging] = (VllmParam(param.shape, pieces), None)
        out[name] = (VllmParam(param.shape, ()), VALUE_DTYPES[fn] or dtype)
        steps.append(ValueStep(TensorRef(None, staging), TensorRef(None, name), fn))  # type: ignore[arg-type]
    return out, steps


def worker_params(dims: ModelDims, target: VllmTarget, hf_plan: Plan, quantization: Fp8Format | None
                  ) -> tuple[dict[str, tuple[VllmParam, str | None]], list[QuantizeStep], set[str], list[ValueStep]]:
    """Worker ``target``'s parameters against ``hf_plan`` (already FP8 where ``quantization``
    is set): ``(name -> (parameter, dtype override), quantize steps, names a step writes,
    value steps)``."""
    params = vllm_params(dims, target)
    steps: list[QuantizeStep] = []
    if quantization is not None:
        typed, steps = _fp8_params(params, hf_plan, quantization)
    else:
        typed = {name: (param, None) for name, param in params.items()}
    typed, transforms = _value_params(typed, hf_plan)
    produced = {r.name for q in steps for r in (q.weight, q.scale)} | {t.target.name for t in transforms}
    return typed, steps, produced, transforms


@lru_cache(maxsize=64)
def plan_megatron_to_vllm(dims: ModelDims, layout: SourceLayout, dtype: str, target: VllmTarget,
                          quantization: Fp8Format | None = None) -> Plan:
    """Plan Megatron shards (``layout``) into vLLM worker ``target``'s own parameter shards.

    Targets are vLLM parameter names (``model.layers.L.self_attn.qkv_proj.weight``,
    ``...mlp.experts.routed_experts.w13_weight``, ``...self_attn.fused_qkv_a_proj.weight``,
    ...) with local shapes (see :mod:`megarefit.targets.vllm_layout`); vocab rows past
    ``vocab_size`` are ``zero_fill``. With ``quantization`` (block FP8) every quantized
    weight is float8_e4m3fn with its ``..._scale_inv`` (``qkv_proj.weight_scale_inv``,
    ``w13_weight_scale_inv`` ``[E_l, 2*I_p/128, hidden/128]``, ...), as vLLM's FP8 layers
    hold them before post-load processing. A ``draft`` target gets the trainers' MTP
    layers as vLLM's MTP drafter holds them (``model.layers.{N+i}.mtp_block...``). A
    vision-language checkpoint's language model is named as vLLM's
    ``*ForConditionalGeneration`` holds it (``language_model.model.layers.L...``,
    ``language_model.lm_head.weight``); its vision tower (``visual.*``) is not in the plan.
    Cached per arguments.

    Raises:
        LayoutError: the model does not split over the worker's groups (names the dim
            and sizes), a bad expert placement (see :func:`vllm_params`), an FP8 part
            off the 128-block grid, or a draft target whose MTP layer count differs from
            the trainers'.
        PlanValidationError: internal inconsistency (a bug).
    """
    experts = worker_experts(dims, target)
    fused = any(r.role.is_fused for r in dims.spec.entries)  # gpt-oss: the pivot holds them as FusedMoE does
    hf_plan = plan_megatron_to_hf(dims, layout, dtype, experts, "out_in" if fused else "in_out",
                                  "draft" if target.draft else "model")
    if quantization is not None:
        hf_plan = plan_fp8(hf_plan, quantization)
    typed, steps, produced, transforms = worker_params(dims, target, hf_plan, quantization)
    with plan_threads():
        return retarget(hf_plan, typed, produced, dtype, steps, digest_of("megatron_to_vllm", hf_plan.digest, target),
                        transforms)


__all__ = ["plan_megatron_to_vllm"]
