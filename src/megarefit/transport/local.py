"""In-process transport: sources are tensors in this process (tests, colocated refit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megarefit.errors import MissingParameterError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, TensorRef


class LocalTransport:
    """Reads plan sources from ``sources[rank][name]`` (``rank`` is ``None`` for HF tensors).

    Contiguous ops copy one flat run; scratch ops copy the strided box with one
    ``copy_`` (the source run is already addressable, so no scratch buffer).
    """

    def __init__(self, sources: Mapping[RankCoord | None, Mapping[str, torch.Tensor]]):
        self._sources = sources

    def _tensor(self, ref: TensorRef) -> torch.Tensor:
        try:
            return self._sources[ref.rank][ref.name]
        except KeyError:
            raise MissingParameterError(f"source tensor {ref} is not available to the local transport") from None

    def pull(self, ops: Sequence[CopyOp], out: torch.Tensor) -> None:
        flat_out = out.view(-1)
        for op in ops:
            src = self._tensor(op.src)
            if op.kind == "contiguous" and src.is_contiguous():
                n = op.numel
                flat_out[op.dst_offset:op.dst_offset + n].copy_(src.view(-1)[op.src_offset:op.src_offset + n])
            else:
                _strided_copy(op, src, out)

    def pull_batch(self, items: Sequence[tuple[Sequence[CopyOp], torch.Tensor]]) -> None:
        """Execute many targets' ops at once. On a GPU all contiguous runs go through one
        batched ``torch._foreach_copy_`` (a few kernel launches instead of one per op);
        on CPU, and for strided ops, one copy each."""
        dsts, srcs = [], []
        for ops, out in items:
            flat_out = out.view(-1)
            for op in ops:
                src = self._tensor(op.src)
                if op.kind == "contiguous" and src.is_contiguous():
                    n = op.numel
                    dsts.append(flat_out[op.dst_offset:op.dst_offset + n])
                    srcs.append(src.view(-1)[op.src_offset:op.src_offset + n])
                else:
                    _strided_copy(op, src, out)
        if dsts and dsts[0].is_cuda:
            torch._foreach_copy_(dsts, srcs)  # fused launches; on CPU a plain loop is faster
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s)

    def view(self, op: CopyOp) -> torch.Tensor | None:
        if op.transpose or op.src_view is not None:
            return None
        src = self._tensor(op.src)
        v = src[op.src_box.slices()]
        return v if v.is_contiguous() else None


def _strided_copy(op: CopyOp, src: torch.Tensor, out: torch.Tensor) -> None:
    """One op as a strided copy, honouring view shapes and transposition."""
    if op.src_view is not None:
        src = src.view(op.src_view)
    copy_part(op, src[op.src_box.slices()], out)


def copy_part(op: CopyOp, part: torch.Tensor, out: torch.Tensor) -> None:
    """``out[op.dst_box] = part``, where ``part`` is the op's source box (shape
    ``op.src_box.lengths``); honours ``op.dst_view`` and ``op.transpose`` (leading
    1-dims dropped, the last two dims swapped: legacy GroupedMLP experts)."""
    if op.dst_view is not None:
        out = out.view(op.dst_view)
    dst = out[op.dst_box.slices()]
    if op.transpose:
        part = part.reshape(part.shape[-2:]).T
        dst.copy_(part.reshape(dst.shape))
    else:
        dst.copy_(part)
