"""Find the elements an optimizer step changed where the optimizer writes them: no mirror.

A bf16 model parameter changes only where Megatron's optimizer copies its fp32 main parameter
into it (``_copy_main_params_to_model_params``: the whole parameter with the non-distributed
mixed-precision optimizer, the rank's shard of Megatron DDP's parameter buffer with the
``DistributedOptimizer``). Just before that copy the old value is in the model parameter and
the new one is the main parameter cast to the model's dtype, so the changed elements can be
found there, on the device, without a second copy of the weights::

    track_changes(optimizer)   on every data-parallel rank: wraps the optimizer's copy
    each step                  per parameter (in chunks): new = main.to(dtype); bits of new
                               != bits of the old model values -> set in a bitmap, 1 bit per
                               element (1/16 of bf16 parameters' bytes, on their device);
                               the DistributedOptimizer's shards: a transient bitmap summed
                               over its data-parallel group (the shards are disjoint, so the
                               sum is the union), then OR-ed into the rank's
    Publisher(..., tracker=)   each publish takes a served tensor's changed elements from the
                               bitmap (accumulated over every step since the last publish) and
                               clears them; tensors the tracker does not cover are compared
                               against a host mirror (delta_log)

Writes that bypass the optimizer's copy are not seen (a checkpoint load, a manual edit):
call :meth:`ChangeTracker.invalidate` after one, and the next publish records no delta
(receivers pull that version in full). Duck-typed on Megatron-Core's optimizers; megatron is
not imported here. Verified on Megatron-Core 0.16-0.19 (tests/test_delta_track.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import MegarefitError
from megarefit.online.delta import mark as delta_mark

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits, by itemsize
CHUNK = 1 << 24  # elements compared (or unpacked) at once: bounds the temporaries
_SHIFTS: dict[torch.device, torch.Tensor] = {}


class DeltaTrackError(MegarefitError):
    """An optimizer whose writes to the model parameters cannot be tracked exactly."""


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[device]


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(BITS[t.element_size()])


def _key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return t.data_ptr(), t.numel(), t.dtype


def or_mask(bitmap: torch.Tensor, start: int, mask: torch.Tensor) -> None:
    """OR the bool ``mask`` ``[n]`` into ``bitmap`` (uint8, bit ``j`` of byte ``b`` is element
    ``8 b + j``) at elements ``start .. start + n``."""
    lo = start - start % 8
    n = start - lo + mask.numel()
    packed = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    packed[start - lo:n] = mask
    bytes_ = (packed.view(-1, 8) << _shifts(mask.device)).sum(1, dtype=torch.uint8)
    bitmap[lo // 8:lo // 8 + bytes_.numel()] |= bytes_


def set_indices(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The elements set in ``bitmap`` (of ``numel`` elements): int64 ``[changed]``, ascending."""
    parts = []
    for a in range(0, bitmap.numel(), CHUNK // 8):
        chunk = bitmap[a:a + CHUNK // 8]
        flags = (chunk[:, None] >> _shifts(chunk.device)) & 1
        parts.append(flags.view(-1).nonzero().view(-1) + 8 * a)
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=bitmap.device)
    return idx[idx < numel] if numel % 8 else idx


def check_span(param: torch.Tensor, source: torch.Tensor, start: int, label: str = "the parameter") -> None:
    """Raises DeltaTrackError unless ``source`` fits ``param``'s flat elements from ``start``
    (``label`` names the parameter)."""
    if start < 0 or start + source.numel() > param.numel():
        raise DeltaTrackError(f"a copy of {source.numel()} elements at element {start} does not fit {label} "
                              f"({param.numel()} elements): expected start + elements <= {param.numel()}")


def _mark(param: torch.Tensor, source: torch.Tensor, bitmap: torch.Tensor, start: int) -> None:
    """OR into ``bitmap`` the elements ``start ..`` of flat ``param`` whose bits a copy of
    ``source`` (cast as ``Tensor.copy_`` casts) would change: one fused launch on a GPU
    (:mod:`~megarefit.online.delta.mark`), else in chunks of :data:`CHUNK` elements."""
    check_span(param, source, start)
    if delta_mark.usable(param, source):
        delta_mark.mark(param, source, bitmap, start, copy=False)
        return
    old, new = _flat_bits(param), source.detach().reshape(-1)
    for a in range(0, new.numel(), CHUNK):
        cast = new[a:a + CHUNK].to(device=param.device, dtype=param.dtype)  # (main params may be offloaded)
        changed = _flat_bits(cast) != old[start + a:start + a + cast.numel()]
        if cast.is_floating_point():
            changed |= cast.isnan()  # as the fused mark: a NaN is always sent
        or_mask(bitmap, start + a, changed)


@dataclass
class _Part:
    """The parameters of one (sub-)optimizer: their bitmaps' byte offsets in ``bits``, and the
    group whose ranks each write disjoint shards of them (None: every rank writes all)."""

    params: list[torch.Tensor]
    offsets: list[int]
    bits: torch.Tensor
    group: Any


class ChangeTracker:
    """Bitmaps of the elements the optimizer's main-to-model copies changed, per tracked
    parameter, since each was last cleared (see the module docstring). Make it with
    :func:`track_changes`, or call :meth:`copy_` in a trainer's own main-to-model copy.

    ``bytes`` (device memory held): ``ceil(numel / 8)`` per tracked parameter."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.index: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {}  # key -> (part, param)
        self.names: dict[tuple[int, int, torch.dtype], str] = {}  # parameter names, where known (errors)
        self.generation = 0  # bumped by invalidate(): a publish that sees it change records no delta
        self.steps = 0
        # a distributed optimizer with overlap_param_gather: the other shards' bytes arrive with the
        # next forward's all-gather, so a Publisher must wait for it (ddp=): marks are cleared when read
        self.deferred_gather = False

    def watch(self, params: Sequence[torch.Tensor], group: Any = None, names: Sequence[str] | None = None) -> int:
        """Track ``params`` (contiguous tensors); ``group``: a process group whose ranks write
        disjoint parts of them (Megatron's distributed-optimizer shards); ``names``: theirs, for
        errors. Returns the part's id.

        Raises:
            DeltaTrackError: a parameter is not contiguous (names it and the rank)."""
        for p, n in zip(params, names or []):
            self.names[_key(p)] = n
        params = [p for p in params if _key(p) not in self.index]
        offsets, at = [], 0
        for p in params:
            if not p.is_contiguous():
                raise DeltaTrackError(f"{self.label(p)} is not contiguous: its changes cannot be tracked")
            offsets.append(at)
            at += (p.numel() + 7) // 8
        device = params[0].device if params else torch.device("cpu")
        self.parts.append(_Part(params, offsets, torch.zeros(at, dtype=torch.uint8, device=device), group))
        for i, p in enumerate(params):
            self.index[_key(p)] = (len(self.parts) - 1, i)
        return len(self.parts) - 1

    def rekey(self) -> int:
        """After a declared move (the tracked parameters' memory freed and re-allocated or
        re-mapped, the tensor objects kept, e.g. verl's offload of Megatron's parameter buffers):
        index every tracked parameter where it is now; its marks stay. A parameter whose storage
        is empty now (freed, not re-allocated) is no longer covered. Returns the parameters indexed."""
        index: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {}
        names: dict[tuple[int, int, torch.dtype], str] = {}
        for old, (part_id, i) in self.index.items():
            p = self.parts[part_id].params[i]
            key = _key(p)
            if (p.data_ptr() == 0 and p.numel()) or key in index:  # freed; or aliasing one indexed first
                continue
            index[key] = (part_id, i)
            if old in self.names:
                names[key] = self.names[old]
        self.index, self.names = index, names
        return len(index)

    def device_of(self, t: torch.Tensor) -> torch.device:
        """The device of tracked ``t``'s bitmap (where its marks are set)."""
        return self.parts[self._where(t)[0]].bits.device

    def label(self, t: torch.Tensor) -> str:
        """``t``'s name (where known), shape, dtype and the process rank, for errors."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        name = self.names.get(_key(t))
        return f"{'parameter ' + repr(name) if name else 'tensor'} {list(t.shape)} {t.dtype} on rank {rank}"

    @property
    def nbytes(self) -> int:
        return sum(part.bits.numel() for part in self.parts)

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a parameter, or a view of all of it) is tracked."""
        return _key(t) in self.index

    def _bitmap(self, part: _Part, i: int, bits: torch.Tensor | None = None) -> torch.Tensor:
        a = part.offsets[i]
        return (part.bits if bits is None else bits)[a:a + (part.params[i].numel() + 7) // 8]

    def note(self, part_id: int, copies: Iterable[tuple[int, int, torch.Tensor]]) -> None:
        """Before a copy of new values into tracked parameters: ``copies`` of ``(param index,
        start element, source)``, each about to copy ``source`` (any dtype; cast as
        ``Tensor.copy_`` casts) into the parameter's flat elements ``start ..
        start + source.numel()``. Marks the elements whose bits will change; with a group, the
        marks are summed over it first (every rank of the group must call this for the step)."""
        part = self.parts[part_id]
        distributed = part.group is not None and torch.distributed.get_world_size(part.group) > 1
        bits = torch.zeros_like(part.bits) if distributed else part.bits
        for i, start, source in copies:
            _mark(part.params[i], source, self._bitmap(part, i, bits), start)
        if distributed:
            torch.distributed.all_reduce(bits, group=part.group)  # disjoint bits: the sum is the union
            part.bits |= bits
        self.steps += 1

    def copy_(self, param: torch.Tensor, source: torch.Tensor, start: int = 0) -> None:
        """``param.view(-1)[start:start + source.numel()].copy_(source)``, marking the elements
        whose bits change (for a trainer's own main-to-model copy; ``param`` tracked, by
        :meth:`watch`, in a part without a group)."""
        part_id, i = self._where(param)
        part = self.parts[part_id]
        if part.group is not None:
            raise DeltaTrackError("copy_ is for parameters tracked without a group (each rank writes all of them)")
        check_span(param, source, start, self.label(param))
        if delta_mark.usable(param, source):  # one pass: cast, compare, mark, write
            delta_mark.mark(param, source, self._bitmap(part, i), start, copy=True)
        else:
            _mark(param, source, self._bitmap(part, i), start)
            param.detach().view(-1)[start:start + source.numel()].copy_(source.reshape(-1))
        self.steps += 1

    def _where(self, t: torch.Tensor) -> tuple[int, int]:
        if _key(t) not in self.index:
            raise DeltaTrackError(f"{self.label(t)} at {t.data_ptr():#x} is not tracked: watch() it, or give the "
                                  "Publisher the tracker of the optimizer that steps it")
        return self.index[_key(t)]

    def changed(self, t: torch.Tensor) -> torch.Tensor:
        """The flat elements of tracked ``t`` changed since it was last cleared: int64
        ``[changed]``, ascending, on its device.

        Raises:
            DeltaTrackError: ``t`` is not tracked."""
        part_id, i = self._where(t)
        return set_indices(self._bitmap(self.parts[part_id], i), t.numel())

    def clear(self, t: torch.Tensor) -> None:
        """Forget ``t``'s changes (its version was published)."""
        part_id, i = self._where(t)
        self._bitmap(self.parts[part_id], i).zero_()

    def invalidate(self) -> None:
        """The parameters were written outside the tracked copy (e.g. a checkpoint load): the
        next publish of each Publisher using this tracker records no delta."""
        self.generation += 1


def _stepped(optimizer: Any, kind: str) -> list[torch.Tensor]:
    """The float16 / bf16 model parameters the optimizer's main-to-model copy writes (on this
    rank). fp32 parameters are left out: the distributed optimizer steps them in place (their
    "main" shard is a view of the parameter), so the copy never sees a change; they keep a mirror."""
    groups = optimizer.model_float16_groups if kind == "distributed" else optimizer.float16_groups
    return [p for g in groups for p in g]


def _range_start(optimizer: Any, param: torch.Tensor) -> int:
    return optimizer._get_model_param_range_map(param)["param"].start


def _distributed_copies(optimizer: Any, index: dict[int, int]) -> list[tuple[int, int, torch.Tensor]]:
    """Megatron-Core ``DistributedOptimizer``: each model parameter's shard of main params and
    where it starts in the parameter (``_get_model_param_range_map(p)["param"]``)."""
    pairs = zip(optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups)
    return [(index[id(p)], _range_start(optimizer, p), main)
            for mains, params in pairs for main, p in zip(mains, params) if main.numel()]


def _float16_copies(optimizer: Any, index: dict[int, int]) -> list[tuple[int, int, torch.Tensor]]:
    """Megatron-Core ``Float16OptimizerWithFloat16Params``: every float16 parameter from its
    whole fp32 main parameter."""
    return [(index[id(p)], 0, main) for mains, params in zip(optimizer.fp32_from_float16_groups,
                                                              optimizer.float16_groups)
            for main, p in zip(mains, params)]


def _check_trackable(optimizer: Any, version: str) -> str:
    """``"distributed"`` or ``"float16"``: which of Megatron-Core's copies ``optimizer`` runs.

    Raises:
        DeltaTrackError: the optimizer writes model parameters some other way, naming it."""
    name = f"{type(optimizer).__name__} (megatron-core {version})"
    config = getattr(optimizer, "config", None)
    for flag in ("use_precision_aware_optimizer_no_fp8_or_ds_fp8", "reuse_grad_buf_for_mxfp8_param_ag"):
        if getattr(config, flag, False):
            raise DeltaTrackError(f"{name}: with {flag} the optimizer writes the model parameters itself; "
                                  "its changes cannot be tracked: use Publisher(delta=True) without a tracker "
                                  "(a host mirror)")
    if getattr(getattr(optimizer, "ddp_config", None), "use_megatron_fsdp", False):
        raise DeltaTrackError(f"{name}: Megatron FSDP writes the model parameters itself; use a host mirror")
    if not callable(getattr(optimizer, "_copy_main_params_to_model_params", None)):
        raise DeltaTrackError(f"{name} has no _copy_main_params_to_model_params: not a mixed-precision "
                              "Megatron-Core optimizer, or a version megarefit has not verified; use a host mirror")
    if all(hasattr(optimizer, a) for a in ("shard_fp32_from_float16_groups", "model_float16_groups",
                                           "_get_model_param_range_map", "data_parallel_group", "buffers")):
        return "distributed"
    if all(hasattr(optimizer, a) for a in ("fp32_from_float16_groups", "float16_groups")):
        return "float16"
    raise DeltaTrackError(f"{name}: neither DistributedOptimizer's nor Float16OptimizerWithFloat16Params' "
                          "parameter groups found; megarefit has not verified this optimizer; use a host mirror")


def _megatron_version() -> str:
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # noqa: BLE001 - only named in an error message
        return "unknown"


def _install(optimizer: Any, tracker: ChangeTracker) -> None:
    kind = _check_trackable(optimizer, _megatron_version())
    if kind == "distributed":  # every float16 parameter of its buffers, in one order on every data-parallel rank
        params = [p for buf in optimizer.buffers for p in buf.params  # (the groups hold only the rank's)
                  if p.dtype in (torch.bfloat16, torch.float16)]
        copies, group = _distributed_copies, optimizer.data_parallel_group
    else:
        params, copies, group = _stepped(optimizer, kind), _float16_copies, None
    names = {id(p): n for chunk in getattr(optimizer, "model_chunks", None) or [] for n, p in chunk.named_parameters()}
    if not params:
        raise DeltaTrackError(f"{type(optimizer).__name__}: no float16 / bf16 parameters to track (fp32 training "
                              "steps its parameters in place); use Publisher(delta=True) without a tracker")
    fp8 = [names.get(id(p)) or list(p.shape) for p in params if type(p.data) is not torch.Tensor]
    if fp8:  # e.g. Transformer Engine's Float8Tensor
        raise DeltaTrackError(f"{type(optimizer).__name__}: FP8 model parameters (fp8 param gather), e.g. {fp8[:3]}, "
                              "cannot be tracked; use Publisher(delta=True) without a tracker")
    ddp_config = getattr(optimizer, "ddp_config", None)
    tracker.deferred_gather |= bool(getattr(ddp_config, "use_distributed_optimizer", False)
                                    and getattr(ddp_config, "overlap_param_gather", False))
    part_id = tracker.watch(params, group, [names.get(id(p), "") for p in params])
    index = {id(p): i for i, p in enumerate(tracker.parts[part_id].params)}
    missing = [names.get(id(p)) or list(p.shape) for p in _stepped(optimizer, kind) if id(p) not in index]
    if missing:
        raise DeltaTrackError(f"{type(optimizer).__name__}: parameters {missing[:4]} are stepped but not in the "
                              "optimizer's buffers (or tracked twice); megarefit has not verified this layout")
    original = optimizer._copy_main_params_to_model_params

    @functools.wraps(original)
    def tracked_copy(*args: Any, **kwargs: Any) -> Any:
        tracker.note(part_id, copies(optimizer, index))
        return original(*args, **kwargs)

    optimizer._copy_main_params_to_model_params = tracked_copy


def track_changes(optimizer: Any, tracker: ChangeTracker | None = None) -> ChangeTracker:
    """Track the model-parameter elements each step of a Megatron-Core optimizer changes.

    ``optimizer``: what ``get_megatron_optimizer`` returns (a ``ChainedOptimizer`` is tracked
    per sub-optimizer), a ``DistributedOptimizer`` or a ``Float16OptimizerWithFloat16Params``.
    Call it on every data-parallel rank (the distributed optimizer's step then sums a bitmap
    over its data-parallel group: ``ceil(numel / 8)`` bytes of the rank's parameters per step,
    1/16 of the bf16 parameter all-gather) and give the tracker to the serving rank's
    ``Publisher(..., delta=True, tracker=...)``. Costs, per step, a cast and a compare of the
    elements copied (in chunks of :data:`CHUNK`) and holds ``ceil(numel / 8)`` bytes per
    parameter on its device.

    Tracked: the float16 / bf16 parameters. fp32 parameters are stepped in place (no copy to
    see), so a Publisher keeps a mirror of them. With the distributed optimizer's
    ``overlap_param_gather`` the Publisher must be given the DDP model (``ddp=``, as
    ``from_megatron`` does) so it waits for the all-gather before it reads (and clears) the marks.

    Raises:
        DeltaTrackError: the optimizer does not write model parameters through Megatron's
            main-to-model copy (precision-aware optimizer, MXFP8 buffer reuse, Megatron FSDP,
            fp32 training, FP8 parameters), or it is not one megarefit has verified, naming the
            version.
    """
    tracker = tracker or ChangeTracker()
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not getattr(opt, "is_stub_optimizer", False):  # (a frozen sub-model's: it copies nothing)
            _install(opt, tracker)
    return tracker


__all__ = ["CHUNK", "ChangeTracker", "DeltaTrackError", "check_span", "or_mask", "set_indices", "track_changes"]
