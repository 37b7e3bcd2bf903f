"""Plan data: tensors by name (:class:`TensorRef`, :class:`TensorMeta`), frozen copy ops
(:class:`CopyOp`) and receiver-side FP8 steps (:class:`QuantizeStep`).

Offsets are kept in **elements**; ``*_byte_offset`` / ``nbytes`` give the same in
**bytes** for the op's itemsize.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from megarefit.errors import PlanValidationError
from megarefit.layout.parallel import Box, RankCoord

Direction = Literal["megatron_to_hf", "hf_to_megatron", "megatron_to_vllm"]
OpKind = Literal["contiguous", "scratch"]

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int32": 4}  # int32: DeepSeek-V4's hash-routing table tid2eid


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise PlanValidationError(f"unsupported dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None


class TensorRef(NamedTuple):
    """A tensor by name; ``rank`` is the Megatron rank, or ``None`` for an HF tensor."""

    rank: RankCoord | None
    name: str

    def __str__(self) -> str:
        return self.name if self.rank is None else f"{self.name} @ rank {self.rank}"


@dataclass(frozen=True)
class TensorMeta:
    """Shape (elements) and dtype of a tensor a plan touches.

    ``zero_fill`` lists boxes of a *target* that no op writes and that must be
    zero: Megatron's vocab padding rows on import. ``storage_shape`` is set when
    the plan addresses the tensor through a row-major view of another shape
    (Megatron's legacy ``GroupedMLP`` ``weight1`` ``[h, E*2F]`` as ``[E, h, 2F]``).
    """

    shape: tuple[int, ...]
    dtype: str
    zero_fill: tuple[Box, ...] = ()
    storage_shape: tuple[int, ...] | None = None  # the stored tensor's shape when ``shape`` is a view of it

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``src[src_box]`` into ``dst[dst_box]`` (same box lengths, up to leading 1-dims).

    ``kind == "contiguous"``: both boxes are single runs, so one transport
    descriptor moves it (a contiguous sliced pull). ``kind == "scratch"``: one
    side is strided (on export, the target box of a row-parallel tensor); move
    the contiguous run through a scratch buffer and copy strided locally.
    No op is strided on both sides.
    """

    src: TensorRef
    src_box: Box
    dst: TensorRef
    dst_box: Box
    kind: OpKind
    src_offset: int  # flat element offset of src_box's first element
    dst_offset: int  # flat element offset of dst_box's first element
    itemsize: int  # bytes per element
    transpose: bool = False  # dst[dst_box] = src[src_box] as a matrix, transposed (see squeezed_lengths)
    src_view: tuple[int, ...] | None = None  # view the stored source as this shape first
    dst_view: tuple[int, ...] | None = None  # view the stored target as this shape first

    @property
    def numel(self) -> int:
        return self.src_box.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def src_byte_offset(self) -> int:
        return self.src_offset * self.itemsize

    @property
    def dst_byte_offset(self) -> int:
        return self.dst_offset * self.itemsize


def squeezed_lengths(lengths: tuple[int, ...], keep: int) -> tuple[int, ...]:
    """``lengths`` without leading, then trailing, length-1 dims while more than ``keep`` dims
    remain: how a box with 1-dims the other side lacks (an expert slot in front, an
    interleave behind) lines up with it; the row-major order of the elements is unchanged."""
    lo, hi = 0, len(lengths)
    while hi - lo > keep and lengths[lo] == 1:
        lo += 1
    while hi - lo > keep and lengths[hi - 1] == 1:
        hi -= 1
    return tuple(lengths[lo:hi])


def make_op(src: TensorRef, src_shape: tuple[int, ...], src_box: Box,
            dst: TensorRef, dst_shape: tuple[int, ...], dst_box: Box, item: int, *, transpose: bool = False,
            src_view: bool = False, dst_view: bool = False) -> CopyOp:
    """``src_view`` / ``dst_view``: the stored tensor is addressed through the view ``*_shape``."""
    both = src_box.is_contiguous_in(src_shape) and dst_box.is_contiguous_in(dst_shape) and not transpose
    kind: OpKind = "contiguous" if both else "scratch"
    return CopyOp(src, src_box, dst, dst_box, kind, src_box.flat_offset(src_shape), dst_box.flat_offset(dst_shape),
                  item, transpose, src_shape if src_view else None, dst_shape if dst_view else None)


def joined(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` as one box when ``b`` continues ``a`` along one dim (every other
    dim equal), else ``None``."""
    for d, (ao, an, bo) in enumerate(zip(a.offsets, a.lengths, b.offsets)):
        if ao + an == bo and a.offsets[:d] + a.offsets[d + 1:] == b.offsets[:d] + b.offsets[d + 1:] \
                and a.lengths[:d] + a.lengths[d + 1:] == b.lengths[:d] + b.lengths[d + 1:]:
            return Box(a.offsets, a.lengths[:d] + (an + b.lengths[d],) + a.lengths[d + 1:])
    return None


def merge_ops(ops: list[CopyOp], sources: Mapping[TensorRef, TensorMeta],
              targets: Mapping[TensorRef, TensorMeta]) -> list[CopyOp]:
    """Merge consecutive contiguous ops between the same two tensors whose source and
    target boxes continue each other and stay single runs when joined: one larger
    contiguous sliced pull (``sources`` / ``targets`` give the shapes)."""
    out: list[CopyOp] = []
    for op in ops:
        prev = out[-1] if out else None
        if prev is not None and prev.kind == op.kind == "contiguous" and prev.src == op.src and prev.dst == op.dst \
                and prev.src_offset + prev.numel == op.src_offset and prev.dst_offset + prev.numel == op.dst_offset:
            src_box, dst_box = joined(prev.src_box, op.src_box), joined(prev.dst_box, op.dst_box)
            src_shape, dst_shape = sources[op.src].shape, targets[op.dst].shape
            if src_box is not None and dst_box is not None and src_box.is_contiguous_in(src_shape) \
                    and dst_box.is_contiguous_in(dst_shape):
                out[-1] = CopyOp(prev.src, src_box, prev.dst, dst_box, "contiguous", prev.src_offset, prev.dst_offset,
                                 prev.itemsize)
                continue
        out.append(op)
    return out



@dataclass(frozen=True)
class QuantizeStep:
    """Block-FP8 quantization on the receiver, after the pulls: ``staging`` (a target the
    ops fill, in the model dtype, never handed over) becomes ``weight`` (float8_e4m3fn,
    same shape) and ``scale`` (float32 ``[..., ceil(N/block[0]), ceil(K/block[1])]``: blocks
    over the last two dims, each leading index -- a FusedMoE expert slot -- on its own),
    two targets no op writes. ``reason`` says why the trainer could not quantize it."""

    staging: TensorRef
    weight: TensorRef
    scale: TensorRef
    block: tuple[int, int]
    ue8m0: bool
    reason: str



ValueFn = Literal["neg_exp", "plus_one", "minus_one", "as_float32"]
VALUE_FNS: dict[str, str] = {  # what each value function computes, and its inverse
    "neg_exp": "target = -exp(staging) in float32 (vLLM MambaMixer2's A = -exp(A_log.float())); "
               "inverse staging = log(-target), not bit-exact (exp and log each round)",
    "plus_one": "target = staging + 1 in the staging dtype, one rounding (a zero-centered Megatron norm weight "
                "w - 1 as HF's w); inverse minus_one, exact for targets in [0.5, 2]",
    "minus_one": "target = staging - 1 in the staging dtype (HF's w as Megatron's zero-centered w - 1), exact for "
                 "staging in [0.5, 2] (Sterbenz); inverse plus_one",
    "as_float32": "target = staging in float32 (vLLM's float32 gated-DeltaNet A_log, MiniMax-M2 router gate); exact, "
                  "inverse a cast back",
}
VALUE_DTYPES: dict[str, str | None] = {"neg_exp": "float32", "plus_one": None, "minus_one": None,
                                       "as_float32": "float32"}
"""The dtype each value function's target has (``None``: the staging's)."""
STAGING_SUFFIX = ":staging"
"""Appended to a target's name for the receiver-side staging target a quantize or value step reads
(model dtype, filled by ops, never handed over)."""


@dataclass(frozen=True)
class ValueStep:
    """An elementwise value transform on the receiver, after the pulls: ``target`` =
    ``fn(staging)`` (:data:`VALUE_FNS`), ``staging`` a target the ops fill in the model dtype
    and never handed over, ``target`` (same shape, dtype :data:`VALUE_DTYPES`) written by no op.
    Where a receiver's tensor is not a copy of trainer bytes (vLLM's Mamba ``A``, an HF gated
    norm's ``w`` from Megatron's zero-centered ``w - 1``), the plan says so here instead of
    hiding it in a loader."""

    staging: TensorRef
    target: TensorRef
    fn: ValueFn


def digest_of(*parts: Any) -> str:
    """Stable short digest of JSON-serializable parts (the plan-cache key)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]



__all__ = ["ITEMSIZE", "STAGING_SUFFIX", "VALUE_DTYPES", "VALUE_FNS", "CopyOp", "Direction", "OpKind", "QuantizeStep", "TensorMeta", "TensorRef",
           "ValueFn", "ValueStep", "digest_of",
           "itemsize", "joined", "make_op", "merge_ops", "squeezed_lengths"]
