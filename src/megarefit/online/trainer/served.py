"""What a Publisher serves besides the live parameters: buffers allocated and registered once.

* FP8 shards (:func:`fp8_buffers`): FP8 weights and float32 block scales, one arena each per
  device, re-filled by every publish;
* snapshot copies (:func:`snapshot_buffers`): one contiguous copy per (device, dtype) that every
  publish refreshes from the live parameters (training may write during a pull);
* checksums (:func:`checksum_buffer`): one int64 buffer holding every served tensor's checksum;
* CUDA IPC handles of what is served (:func:`export_ipc`), for receivers on the same GPU.

Buffers are laid out back to back in layout order, so consecutive pulls of a receiver coalesce
into few large NIXL descriptors.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from megarefit.quant.fp8 import FP8_DTYPE, Fp8Format
from megarefit.transport.checksum import frame_entries, sum_frame, tensor_checksum
from megarefit.transport.checksum_kernel import BoxSums
from megarefit.transport.cuda_ipc import export_storages
from megarefit.transport.manifest import TensorEntry


def warn_expandable_segments(served: Sequence[torch.Tensor], who: str) -> None:
    """Warn (at the caller of ``Publisher(...)``) when CUDA tensors are served while PyTorch's
    allocator uses expandable segments (VMM memory: RDMA NICs fault on it at transfer time)."""
    if any(t.is_cuda for t in served) and "expandable_segments:true" in (
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower():
        warnings.warn(f"{who}: serving CUDA memory allocated with expandable_segments; NIXL "
                      "registration of VMM-mapped memory succeeds but RDMA NICs fault at transfer time. "
                      "Unset expandable_segments for the trainer, or serve through CUDA IPC only.", stacklevel=3)


def export_ipc(tensors: Sequence[torch.Tensor], who: str) -> tuple:
    """CUDA IPC records of the storages of ``tensors`` (none for host memory,
    :func:`~megarefit.transport.cuda_ipc.export_storages`); a warning and none where PyTorch
    cannot export them (receivers on the same GPU then read over NIXL)."""
    try:
        return export_storages(list(tensors))
    except RuntimeError as exc:
        warnings.warn(f"{who}: cannot export CUDA IPC handles ({exc}); receivers on this GPU "
                      "read over NIXL", stacklevel=3)
        return ()


def fp8_buffers(params: Mapping[str, torch.Tensor], names: Sequence[str],
                fmt: Fp8Format) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """FP8 weights (the parameter's shape) and float32 scales (``fmt.scale_shape``) of ``names``,
    as views of one arena each per device, back to back in the order of ``names``."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for device in {params[n].device for n in names}:
        mine = [n for n in names if params[n].device == device]
        shapes = {n: (tuple(params[n].shape), fmt.scale_shape(tuple(params[n].shape))) for n in mine}
        weights = torch.empty(sum(math.prod(w) for w, _ in shapes.values()), dtype=FP8_DTYPE, device=device)
        scales = torch.empty(sum(math.prod(s) for _, s in shapes.values()), dtype=torch.float32, device=device)
        at_w = at_s = 0
        for n in mine:
            w, s = shapes[n]
            out[n] = (weights[at_w:at_w + math.prod(w)].view(w), scales[at_s:at_s + math.prod(s)].view(s))
            at_w, at_s = at_w + math.prod(w), at_s + math.prod(s)
    return {n: out[n] for n in names}


def snapshot_buffers(params: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """One contiguous buffer per (device, dtype) holding a copy of each of ``names``, filled now."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for n in names:
        groups.setdefault((params[n].device, params[n].dtype), []).append(n)
    for (device, dtype), group in groups.items():
        flat = torch.empty(sum(params[n].numel() for n in group), dtype=dtype, device=device)
        at = 0
        for n in group:
            out[n] = flat[at:at + params[n].numel()].view(params[n].shape)
            out[n].copy_(params[n].detach())
            at += params[n].numel()
    return out


def refresh_snapshot(snapshot: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """Copy the live parameters into their snapshot buffers (one fused launch on a GPU, then synchronize)."""
    names = list(snapshot)
    dst, src = [snapshot[n] for n in names], [params[n].detach() for n in names]
    if dst[0].is_cuda:
        torch._foreach_copy_(dst, src)
        torch.cuda.synchronize(dst[0].device)
    else:
        for d, x in zip(dst, src):
            d.copy_(x)


def checksum_buffer(served: Sequence[torch.Tensor], entries: Sequence[TensorEntry],
                    local_experts: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """One int64 buffer holding every served tensor's checksum back to back (in manifest order,
    on the device of the first; legacy GroupedMLP tensors summed per local expert,
    :func:`~megarefit.transport.checksum.sum_frame`), and what fills it: one fused pass over
    every served tensor (:class:`~megarefit.transport.checksum_kernel.BoxSums`; per tensor where
    the tensors span devices). The caller registers the buffer. ``out``: that buffer again, for the
    tensors at their new addresses after a declared move (the fill reads addresses)."""
    frames = [sum_frame(t.shape, e.role, local_experts) for t, e in zip(served, entries, strict=True)]
    flat = out if out is not None else torch.zeros(sum(f.numel for f in frames), dtype=torch.int64,
                                                   device=served[0].device)
    boxes, starts, at = [], [], 0
    for t, f in zip(served, frames):
        boxes += frame_entries(t, f, at)
        starts.append(at)
        at += f.numel
    if all(t.device == flat.device for t in served):
        return flat, BoxSums(boxes, flat)

    def per_tensor() -> None:
        for t, f, start in zip(served, frames, starts):
            flat[start:start + f.numel].copy_(tensor_checksum(t, frame=f))

    return flat, per_tensor


__all__ = ["checksum_buffer", "export_ipc", "fp8_buffers", "refresh_snapshot", "snapshot_buffers",
           "warn_expandable_segments"]
