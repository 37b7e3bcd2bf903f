"""In-process transport: sources are tensors in this process (tests, colocated refit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megarefit.errors import MegarefitError, MissingParameterError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, TensorRef


class LocalTransport:
    """Reads plan sources from ``sources[rank][name]`` (``rank`` is ``None`` for HF tensors).

    Contiguous ops copy one flat run; scratch ops copy the strided box with one
    ``copy_`` (the source run is already addressable, so no scratch buffer).
    :meth:`pull_batch` with a ``key`` compiles the ops once into (destination view,
    source view) pairs and reuses them while the sources and buffers keep their
    memory: a warm cycle is then one ``torch._foreach_copy_`` call on a GPU, with
    no per-op Python.
    """

    def __init__(self, sources: Mapping[RankCoord | None, Mapping[str, torch.Tensor]]):
        self._sources = sources
        self._compiled: dict[object, _Compiled] = {}

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

    def pull_batch(self, items: Sequence[tuple[Sequence[CopyOp], torch.Tensor]], *, key: object = None) -> None:
        """Execute many targets' ops at once (all contiguous runs through one
        ``torch._foreach_copy_`` on a GPU; one copy each on CPU, where a plain loop is
        faster). With ``key`` (e.g. the plan digest and the buffers' addresses) the
        (destination, source) views are built once and reused on later calls with the
        same key, after checking that every source still has the same memory."""
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is None or not compiled.valid(self):
            compiled = _Compiled.build(self, items)
            if key is not None:
                self._compiled = {key: compiled}  # one layout at a time
        compiled.run()

    def view(self, op: CopyOp) -> torch.Tensor | None:
        if op.transpose or op.src_view is not None:
            return None
        src = self._tensor(op.src)
        v = src[op.src_box.slices()]
        return v if v.is_contiguous() else None


# Copies move bits, so a (destination, source) pair may be reinterpreted as wider words
# when both allow it (innermost dim contiguous, sizes, strides and offsets aligned).
# Measured on an H200 (bf16 Qwen3-8B, tp=2): contiguous runs through _foreach_copy_
# 8.2 ms as bf16 -> 6.5 ms as int32; strided row-parallel boxes 6.0 ms -> 3.0 ms as
# int64 (the generic strided kernel moves one element per thread).
RUN_WORD = torch.int32
BOX_WORD = torch.int64


def widened(dst: torch.Tensor, src: torch.Tensor, word: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed as ``word`` (same bits), or unchanged if either cannot be."""
    size = torch.empty((), dtype=word).element_size()
    if dst.element_size() >= size or dst.dtype != src.dtype or dst.shape != src.shape or dst.dim() == 0:
        return dst, src

    def fits(t: torch.Tensor) -> bool:
        item = t.element_size()
        return (t.stride(-1) == 1 and (t.shape[-1] * item) % size == 0 and (t.storage_offset() * item) % size == 0
                and all((st * item) % size == 0 for st in t.stride()[:-1]))

    if fits(dst) and fits(src):
        return dst.view(word), src.view(word)
    return dst, src


class _Compiled:
    """Precomputed copies of a batch: contiguous (destination, source) runs, and strided
    boxes, kept apart so the contiguous ones take ``torch._foreach_copy_``'s fused
    multi-tensor path on a GPU (one non-contiguous tensor in a list sends the whole
    list down the one-kernel-per-tensor path)."""

    def __init__(self, runs: tuple[list[torch.Tensor], list[torch.Tensor]],
                 boxes: tuple[list[torch.Tensor], list[torch.Tensor]], used: list[tuple[TensorRef, torch.Tensor]]):
        self.runs, self.boxes, self.used = runs, boxes, used

    @classmethod
    def build(cls, transport: LocalTransport, items: Sequence[tuple[Sequence[CopyOp], torch.Tensor]]) -> _Compiled:
        runs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        boxes: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        used = {}
        for ops, out in items:
            flat_out = out.view(-1)
            for op in ops:
                src = transport._tensor(op.src)
                used[op.src] = src
                if op.kind == "contiguous" and src.is_contiguous():
                    n = op.numel
                    d, s = widened(flat_out[op.dst_offset:op.dst_offset + n], src.view(-1)[op.src_offset:op.src_offset + n],
                                   RUN_WORD)
                    runs[0].append(d)
                    runs[1].append(s)
                else:
                    d, s = widened(*op_views(op, src, out), BOX_WORD)
                    boxes[0].append(d)
                    boxes[1].append(s)
        return cls(runs, boxes, list(used.items()))

    def valid(self, transport: LocalTransport) -> bool:
        """The sources are the same tensors, at the same addresses, as when compiled."""
        for ref, t in self.used:
            now = transport._tensor(ref)
            if now is not t or now.data_ptr() != t.data_ptr():
                return False
        return True

    def run(self) -> None:
        for dsts, srcs in (self.runs, self.boxes):
            if dsts and dsts[0].is_cuda:
                torch._foreach_copy_(dsts, srcs)  # fused launches for the runs; on CPU a plain loop is faster
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s)


def squeezed(t: torch.Tensor, keep: int) -> torch.Tensor:
    """``t`` without leading, then trailing, size-1 dims while more than ``keep`` remain (a
    view; :func:`~megarefit.plan.ops.squeezed_lengths` on tensors)."""
    while t.dim() > keep and t.shape[0] == 1:
        t = t[0]
    while t.dim() > keep and t.shape[-1] == 1:
        t = t[..., 0]
    return t


def op_views(op: CopyOp, src: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination view, source view) of one op, same shape, both views (no copies):
    honours ``src_view`` / ``dst_view`` and ``transpose`` (1-dims dropped, the matrix
    transposed: legacy GroupedMLP experts, gpt-oss's fused experts)."""
    if op.src_view is not None:
        src = src.view(op.src_view)
    return part_views(op, src[op.src_box.slices()], out)


def part_views(op: CopyOp, part: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`op_views` for ``part``, the op's source box already cut out."""
    if op.dst_view is not None:
        out = out.view(op.dst_view)
    dst = out[op.dst_box.slices()]
    if op.transpose:
        part = squeezed(part, 2).T
        dst = squeezed(dst, 2)
    elif part.shape != dst.shape and part.numel() == dst.numel():
        part = part.reshape(dst.shape)  # 1-dims the other side lacks (FusedMoE slot, gate/up interleave): a view
    if tuple(part.shape) != tuple(dst.shape):
        raise MegarefitError(f"op {op.src} -> {op.dst}: source box {tuple(part.shape)} does not fit "
                             f"destination box {tuple(dst.shape)}")
    return dst, part


def _strided_copy(op: CopyOp, src: torch.Tensor, out: torch.Tensor) -> None:
    """One op as a strided copy, honouring view shapes and transposition."""
    dst, part = op_views(op, src, out)
    dst.copy_(part)
