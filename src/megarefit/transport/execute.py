"""Receiver: execute a plan through a transport, one target tensor at a time.

``run_refit_cycle`` yields ``(hf_name, tensor)`` pairs in the form vLLM's
``model.load_weights(weights)`` consumes. Only the tensor being assembled is
alive inside the generator, so extra memory is bounded by the largest target
(and by nothing when the target is a zero-copy view of a local source).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from megarefit.errors import MegarefitError, ShapeMismatchError
from megarefit.layout import Box
from megarefit.plan import CopyOp, Plan, QuantizeStep, TensorMeta, TensorRef, ValueStep
from megarefit.transport.base import Transport


@dataclass
class RefitStats:
    """Counters of one refit cycle: seconds per stage and bytes moved (not counting views)."""

    pull_s: float = 0.0
    tensors: int = 0
    views: int = 0
    bytes_copied: int = 0
    bytes_viewed: int = 0
    stages: dict[str, float] = field(default_factory=dict)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MegarefitError(f"unknown torch dtype {name!r}")
    return dtype


_VALIDATED: set[object] = set()  # (plan digest, buffers' identities) already checked


def materialize(plan: Plan, transport: Transport, *, views: bool = True, device: torch.device | str = "cpu",
                buffers: Mapping[TensorRef, torch.Tensor] | None = None,
                stats: RefitStats | None = None) -> Iterator[tuple[TensorRef, torch.Tensor]]:
    """Yield every target of ``plan`` as a tensor, in plan order.

    A target with an entry in ``buffers`` is written in place into that tensor
    (contiguous, the target's shape and the plan's dtype; ``zero_fill`` boxes are
    zeroed): warm refit cycles allocate nothing. When every target has a buffer
    and the transport offers ``pull_batch``, all targets are pulled in one batch
    before the first is yielded (fewer kernel launches on a GPU). Otherwise, a target written by a
    single op that covers all of it is yielded as a zero-copy view of the source
    when ``views`` is true and the transport can address the source (it shares
    memory with the source); the rest are freshly allocated and filled by
    ``transport.pull``.

    Raises:
        ShapeMismatchError: a buffer's shape, dtype or layout does not fit its target.
    """
    by_target = plan.ops_by_target
    key = _checked_buffers_key(plan, buffers)
    batched = False
    produced = plan.produced
    if buffers and hasattr(transport, "pull_batch") and all(ref in buffers for ref in plan.targets):
        # every target has a buffer: one batched pull (no streaming needed), then yield
        _pull_batch(plan, transport, buffers, key, stats)
        batched = True
    done: dict[TensorRef, torch.Tensor] = {}  # quantize / value step outputs waiting for their turn
    steps: dict[TensorRef, QuantizeStep | ValueStep] = {q.staging: q for q in plan.quantize}
    steps.update((t.staging, t) for t in plan.transforms)
    for ref, meta in plan.targets.items():
        ops = by_target[ref]
        t0 = time.perf_counter()
        buf = buffers.get(ref) if buffers else None
        if ref in produced and not batched:
            yield ref, done.pop(ref)
            continue
        if batched:
            tensor = buffers[ref]  # type: ignore[index]
        else:
            tensor = _pull_target(meta, ops, transport, buf, views=views, device=device, stats=stats)
        if stats is not None:
            stats.pull_s += time.perf_counter() - t0
            stats.tensors += 1
        step = steps.get(ref)
        if step is not None:  # staging: quantize / transform now, hand over the results in their turn
            if not batched:
                done.update(_quantize_staging(plan, step, tensor, buffers) if isinstance(step, QuantizeStep)
                            else _transform_staging(plan, step, tensor, buffers))
            continue
        yield ref, tensor


def _checked_buffers_key(plan: Plan, buffers: Mapping[TensorRef, torch.Tensor] | None) -> object:
    """Identity of ``(plan, buffers)`` (``None`` without buffers), after checking each buffer
    fits its target: contiguous, the target's (storage) shape, the plan's dtype. A key
    already checked (warm cycles into the same buffers) skips the checks.

    Raises:
        ShapeMismatchError: a buffer's shape, dtype or layout does not fit its target.
    """
    if not buffers:
        return None
    key = (plan.digest, tuple((id(b), b.data_ptr(), b.dtype, b.shape) for b in buffers.values()))
    if key not in _VALIDATED:
        for ref, buf in buffers.items():
            meta = plan.targets.get(ref)
            if meta is not None and (tuple(buf.shape) != (meta.storage_shape or meta.shape)
                                     or buf.dtype != torch_dtype(meta.dtype) or not buf.is_contiguous()):
                raise ShapeMismatchError(
                    f"buffer for {ref}: expected contiguous {meta.dtype} {meta.storage_shape or meta.shape}, got "
                    f"{str(buf.dtype).removeprefix('torch.')} {tuple(buf.shape)} contiguous={buf.is_contiguous()}"
                )
        if len(_VALIDATED) > 8:
            _VALIDATED.clear()
        _VALIDATED.add(key)  # warm cycles into the same buffers skip the checks
    return key


def _pull_batch(plan: Plan, transport: Transport, buffers: Mapping[TensorRef, torch.Tensor], key: object,
                stats: RefitStats | None) -> None:
    """Fill every target's buffer at once: zero the ``zero_fill`` boxes, one ``transport.pull_batch``
    of all op-written targets, then run the plan's quantize steps (staging -> FP8 weight + scales)."""
    t0 = time.perf_counter()
    by_target, produced = plan.ops_by_target, plan.produced
    for ref, meta in plan.targets.items():
        for box in meta.zero_fill:
            buffers[ref][box.slices()].zero_()
    transport.pull_batch([(by_target[ref], buffers[ref]) for ref in plan.targets if ref not in produced], key=key)
    for step in plan.quantize:
        run_quantize_step(step, buffers[step.staging], buffers[step.weight], buffers[step.scale])
    for t in plan.transforms:
        run_value_step(t, buffers[t.staging], buffers[t.target])
    if stats is not None:
        stats.pull_s += time.perf_counter() - t0
        stats.bytes_copied += plan.nbytes


def _pull_target(meta: TensorMeta, ops: tuple[CopyOp, ...], transport: Transport, buf: torch.Tensor | None, *,
                 views: bool, device: torch.device | str, stats: RefitStats | None) -> torch.Tensor:
    """One target (``meta``, written by ``ops``) as a tensor: pulled into ``buf`` when given, else a
    zero-copy view of the source (one op covering the whole target, ``views`` on, the transport
    can address the source), else freshly allocated on ``device`` and pulled into. Counts bytes
    copied / viewed in ``stats``; the caller times it."""
    tensor = None
    if buf is not None:
        for box in meta.zero_fill:
            buf[box.slices()].zero_()
        transport.pull(ops, buf)
        tensor = buf
        if stats is not None:
            stats.bytes_copied += sum(op.nbytes for op in ops)
    elif (views and len(ops) == 1 and not meta.zero_fill and meta.storage_shape is None
          and ops[0].dst_box == Box.full(meta.shape)):
        tensor = transport.view(ops[0])
        if tensor is not None:
            tensor = tensor.view(meta.shape)  # a box may lack the target's leading 1-dims (an expert slot)
        if tensor is not None and stats is not None:
            stats.views += 1
            stats.bytes_viewed += ops[0].nbytes
    if tensor is None:
        alloc = torch.zeros if meta.zero_fill else torch.empty
        tensor = alloc(meta.storage_shape or meta.shape, dtype=torch_dtype(meta.dtype), device=device)
        transport.pull(ops, tensor)
        if stats is not None:
            stats.bytes_copied += sum(op.nbytes for op in ops)
    return tensor


def _quantize_staging(plan: Plan, step: QuantizeStep, staging: torch.Tensor,
                      buffers: Mapping[TensorRef, torch.Tensor] | None) -> dict[TensorRef, torch.Tensor]:
    """Quantize a pulled ``staging`` tensor; return its FP8 weight and scales by target (their
    buffers when given, else allocated on the staging tensor's device), to be yielded in their turn."""
    out = {r: buffers[r] if buffers and r in buffers
           else torch.empty(plan.targets[r].shape, dtype=torch_dtype(plan.targets[r].dtype), device=staging.device)
           for r in (step.weight, step.scale)}
    run_quantize_step(step, staging, out[step.weight], out[step.scale])
    return out


def _transform_staging(plan: Plan, step: ValueStep, staging: torch.Tensor,
                       buffers: Mapping[TensorRef, torch.Tensor] | None) -> dict[TensorRef, torch.Tensor]:
    """A value step's target from its pulled ``staging`` tensor (its buffer when given)."""
    meta = plan.targets[step.target]
    out = buffers[step.target] if buffers and step.target in buffers else torch.empty(
        meta.storage_shape or meta.shape, dtype=torch_dtype(meta.dtype), device=staging.device)
    run_value_step(step, staging, out)
    return {step.target: out}


def run_value_step(step: ValueStep, staging: torch.Tensor, out: torch.Tensor) -> None:
    """``out = fn(staging)`` (:data:`~megarefit.plan.ops.VALUE_FNS`): ``neg_exp`` computes
    ``-exp(staging)`` in float32, the operations vLLM's ``A`` loader runs, so bit-identical to it;
    ``plus_one`` / ``minus_one`` add / subtract 1 in ``out``'s dtype (one rounding); ``as_float32``
    copies into float32 ``out`` (exact).

    Raises:
        MegarefitError: an unknown function (a plan from a newer megarefit).
    """
    if step.fn == "neg_exp":
        torch.exp(staging.to(torch.float32), out=out)
        out.neg_()
    elif step.fn in ("plus_one", "minus_one"):
        torch.add(staging, 1 if step.fn == "plus_one" else -1, out=out)
    elif step.fn == "as_float32":
        out.copy_(staging)
    else:
        raise MegarefitError(f"value step for {step.target}: unknown function {step.fn!r}")


def run_quantize_step(step: QuantizeStep, staging: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Block-quantize the staging tensor into the step's FP8 weight and scale buffers."""
    from megarefit.quant.fp8 import Fp8Format, quantize_fp8

    for s, w, c in slots(staging, weight, scale):
        quantize_fp8(s, Fp8Format(step.block, step.ue8m0), out=w, scale_out=c)


def slots(staging: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
          ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """2-D ``(staging, weight, scale)`` triples of a quantize step: one per leading index
    (FusedMoE expert slot) of an N-D target, itself for a 2-D one."""
    if staging.dim() == 2:
        return [(staging, weight, scale)]
    s, w, c = (t.reshape(-1, *t.shape[-2:]) for t in (staging, weight, scale))
    return [(s[i], w[i], c[i]) for i in range(s.shape[0])]


def run_refit_cycle(plan: Plan, transport: Transport, *, views: bool = True, device: torch.device | str = "cpu",
                    buffers: Mapping[str, torch.Tensor] | None = None,
                    stats: RefitStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Execute a Megatron->HF plan; yield ``(hf_name, tensor)`` for ``model.load_weights``.

    Tensors are full HF tensors (shapes as the HF checkpoint), vocab padding
    trimmed, in the plan's dtype. ``buffers`` maps HF names to preallocated
    destination tensors written in place (e.g. a previous cycle's outputs, or an
    HF model's own parameters); see :func:`materialize`. Pass ``stats`` to
    collect timings and bytes.

    Raises:
        MegarefitError: ``plan`` is not a ``megatron_to_hf`` plan.
        Whatever the transport raises for a failed pull (names the tensor).
    """
    if plan.direction not in ("megatron_to_hf", "megatron_to_vllm"):
        raise MegarefitError(f"run_refit_cycle needs a megatron_to_hf / megatron_to_vllm plan, got {plan.direction}")
    refs = {TensorRef(None, name): t for name, t in buffers.items()} if buffers else None
    for ref, tensor in materialize(plan, transport, views=views, device=device, buffers=refs, stats=stats):
        yield ref.name, tensor
