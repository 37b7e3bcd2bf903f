"""Per-tensor checksums a trainer rank publishes and a receiver checks, on device.

A served tensor of stored shape ``[..., C]`` is read as a matrix ``x[R, C]`` (``R`` the
product of the leading dims; a 0-d tensor is ``[1, 1]``) of its raw bits as integers (a
bf16 element is its int16 bits, fp32 its int32 bits, FP8 its uint8 bits). Its checksum is
``R + C`` int64 values, computed with integer arithmetic (exact; wraps modulo 2^64, so the
order of the additions does not matter and a receiver reproduces a trainer's sums bit for
bit on any device)::

    row_sums[i] = sum_j w(j) * x[i, j]        (i < R)
    col_sums[j] = sum_i w(i) * x[i, j]        (j < C),   w(n) = n mod 65521 + 1

The position weights catch swapped elements, not only changed ones. A receiver pulls boxes
of a trainer's tensor (:class:`~megarefit.plan.CopyOp` ``src_box``): a box spanning whole
rows is checked against those rows' sums, a box spanning every row against its columns'
sums (every box of the column-, row- and vocab-parallel layouts).

Legacy GroupedMLP experts (roles ``grouped_expert_fc1`` / ``grouped_expert_fc2``) hold the
``E`` local experts back to back whatever their stored 2-D shape says, and a plan pulls one
expert's gate, up or down block at a time. Their sums are taken per expert, as a batch of
``E`` matrices (the plan's view of the tensor, :func:`sum_frame`)::

    weight1 stored [h, E*2F] = memory [E, h, 2F]:  expert e is x_e[h, 2F]
    weight2 stored [E*F, h]  = memory [E, F, h]:   expert e is x_e[F, h]
    sums: [row_sums(x_0) .. row_sums(x_{E-1})]  then  [col_sums(x_0) .. col_sums(x_{E-1})]

so an expert's gate (every row of ``x_e``, columns ``[0, F)``) is checked against its
columns' sums. Every other tensor is one matrix (``E = 1``). A box that is neither whole
rows nor every row of one matrix cannot be checked (:func:`box_kind` returns ``None``; a
receiver refuses such a plan before it pulls, :class:`UncheckableBoxError`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from megarefit.errors import MegarefitError
from megarefit.layout.geometry import grouped_view_of
from megarefit.plan import CopyOp
from megarefit.specs import Role

MODULUS = 65521  # the largest prime below 2**16: weights 1..65521
_CHUNK = 1 << 24  # elements per partial product (bounds the temporary int tensors)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumMismatchError(MegarefitError):
    """Pulled bytes differ from what the trainer rank published for them: names the source
    tensor, rank, rows or columns, the target and the sums."""


class UncheckableBoxError(MegarefitError):
    """``verify_checksums=True`` was asked of a plan with a box no published sum covers (not
    whole rows, nor every row, of the matrix its source is summed as): names the source
    tensors, ranks, boxes and why. Raised before any byte is pulled."""


class SumFrame(NamedTuple):
    """How a served tensor is summed: ``batch`` matrices ``[rows, cols]`` back to back in its
    memory (``batch`` > 1 only for legacy GroupedMLP experts: one matrix per local expert)."""

    batch: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        """int64 values of the tensor's checksum: ``batch * (rows + cols)``."""
        return self.batch * (self.rows + self.cols)

    @property
    def view(self) -> tuple[int, ...]:
        """The shape boxes of a batched tensor are addressed in: ``(batch, rows, cols)``."""
        return (self.batch, self.rows, self.cols)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(R, C)``: the ``[rows, columns]`` a tensor of ``shape`` is summed as (elements)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


_GROUPED = frozenset({Role.GROUPED_EXPERT_FC1.value, Role.GROUPED_EXPERT_FC2.value})


def sum_frame(shape: Sequence[int], role: str = "", experts: int = 1) -> SumFrame:
    """The frame a served tensor of stored ``shape`` and manifest ``role`` is summed in, on a
    rank holding ``experts`` local experts: a legacy GroupedMLP tensor as ``experts`` matrices
    (the plan's ``[E, a, b]`` view of it, :func:`megarefit.layout.geometry.grouped_view_of`),
    every other tensor as one ``matrix_shape``."""
    view = grouped_view_of(Role(role), tuple(shape), experts) if experts > 1 and role in _GROUPED else None
    return SumFrame(*view) if view is not None else SumFrame(1, *matrix_shape(shape))


def checksum_numel(shape: Sequence[int], role: str = "", experts: int = 1) -> int:
    """int64 values of one tensor's checksum (:func:`sum_frame`'s ``numel``)."""
    return sum_frame(shape, role, experts).numel


def _weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device).remainder_(MODULUS).add_(1)


def _ints(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as int64 (a view's bits, not its values)."""
    return t.contiguous().view(_BITS[t.element_size()]).to(torch.int64)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64 sums ``sum_j w(j) * bits(x[i, j])`` of a 2-D tensor ``x[R, C]``."""
    w = _weights(x.shape[1], x.device)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    step = max(1, _CHUNK // max(1, x.shape[1]))
    for at in range(0, x.shape[0], step):
        out[at:at + step] = (_ints(x[at:at + step]) * w).sum(1)
    return out


def col_sums(x: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """``[C]`` int64 sums ``sum_i w(first_row + i) * bits(x[i, j])`` of a 2-D tensor ``x[R, C]``."""
    out = torch.zeros(x.shape[1], dtype=torch.int64, device=x.device)
    step = max(1, _CHUNK // max(1, x.shape[1]))
    for at in range(0, x.shape[0], step):
        part = x[at:at + step]
        w = _weights(first_row + at + part.shape[0], x.device)[first_row + at:]
        out += (_ints(part) * w[:, None]).sum(0)
    return out


def frame_entries(t: torch.Tensor, frame: SumFrame, at: int = 0) -> list[tuple[torch.Tensor, int, int, int]]:
    """``t``'s matrices as :class:`~megarefit.transport.checksum_kernel.BoxSums` entries
    ``(x[rows, cols], row_out, col_out, 0)`` writing its checksum at ``at`` of the output."""
    b, rows, cols = frame
    x = t.detach().reshape(b, rows, cols)
    return [(x[e], at + e * rows, at + b * rows + e * cols, 0) for e in range(b)]


def tensor_checksum(t: torch.Tensor, out: torch.Tensor | None = None, frame: SumFrame | None = None) -> torch.Tensor:
    """A served tensor's checksum in ``frame`` (default: one matrix): ``[frame.numel]`` int64,
    every matrix's row sums, then every matrix's column sums (written into ``out`` when given)."""
    frame = frame or SumFrame(1, *matrix_shape(t.shape))
    if out is None:
        out = torch.empty(frame.numel, dtype=torch.int64, device=t.device)
    for x, row_out, col_out, _ in frame_entries(t, frame):
        out[row_out:row_out + frame.rows] = row_sums(x)
        out[col_out:col_out + frame.cols] = col_sums(x)
    return out


def _plain_kind(offsets: Sequence[int], lengths: Sequence[int], shape: Sequence[int]
                ) -> tuple[str, int, int, int] | None:
    """:func:`box_kind` for a box of a tensor of ``shape`` summed as one matrix."""
    n_rows, n_cols = matrix_shape(shape)
    if len(shape) == 0:
        return "rows", 0, 1, 1
    lead, lead_shape = tuple(lengths[:-1]), tuple(shape[:-1])
    if lengths[-1] == n_cols:  # whole rows: consecutive when, after leading 1s and one dim, every dim is whole
        k = 0
        while k < len(lead) - 1 and lead[k] == 1:
            k += 1
        if lead[k + 1:] != lead_shape[k + 1:]:
            return None
        first = sum(o * math.prod(lead_shape[i + 1:]) for i, o in enumerate(offsets[:-1]))
        return "rows", first, math.prod(lead), n_cols
    if lead == lead_shape:  # every row, some columns
        return "cols", n_rows + offsets[-1], n_rows, lengths[-1]
    return None


def box_kind(op: CopyOp, shape: Sequence[int], frame: SumFrame | None = None) -> tuple[str, int, int, int] | None:
    """How ``op``'s source box can be checked, its source stored as ``shape`` and summed in
    ``frame`` (default: one matrix): ``("rows", first, rows, cols)`` (it spans whole rows of
    the matrices: checksum entries ``first..first + rows``), ``("cols", first, rows, cols)``
    (it spans every row of one matrix: entries ``first..first + cols``, after the rows), or
    ``None`` (neither; or a box addressed in a shape that is not the frame's). ``rows, cols``:
    the box as a ``[rows, cols]`` matrix in source order."""
    frame = frame or SumFrame(1, *matrix_shape(shape))
    coords = op.src_view if op.src_view is not None else tuple(shape)
    box = op.src_box
    if frame.batch == 1:
        return _plain_kind(box.offsets, box.lengths, coords) if matrix_shape(coords) == frame[1:] else None
    if tuple(coords) != frame.view:
        return None
    b, rows, cols = frame
    (e, r0, c0), (ne, nr, nc) = box.offsets, box.lengths
    if nc == cols and (ne == 1 or nr == rows):  # whole rows, of one expert or of consecutive whole experts
        return "rows", e * rows + r0, ne * nr, cols
    if ne == 1 and nr == rows:  # every row of one expert, some columns
        return "cols", b * rows + e * cols + c0, rows, nc
    return None


def box_sums(op: CopyOp, shape: Sequence[int], data: torch.Tensor, frame: SumFrame | None = None
             ) -> tuple[str, int, torch.Tensor] | None:
    """``(kind, first, sums)`` of a pulled box (``data`` shaped as ``op.src_box``) as
    :func:`box_kind` says it can be checked (torch arithmetic), or ``None``."""
    kind = box_kind(op, shape, frame)
    if kind is None:
        return None
    what, first, rows, cols = kind
    x = data.reshape(rows, cols)
    return what, first, row_sums(x) if what == "rows" else col_sums(x)


__all__ = ["MODULUS", "ChecksumMismatchError", "SumFrame", "UncheckableBoxError", "box_kind", "box_sums",
           "checksum_numel", "col_sums", "frame_entries", "matrix_shape", "row_sums", "sum_frame", "tensor_checksum"]
