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
sums (every box of the column-, row- and vocab-parallel layouts); any other box (and a
source addressed through a view of another shape) is counted as unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megarefit.errors import MegarefitError
from megarefit.plan import CopyOp

MODULUS = 65521  # the largest prime below 2**16: weights 1..65521
_CHUNK = 1 << 24  # elements per partial product (bounds the temporary int tensors)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumMismatchError(MegarefitError):
    """Pulled bytes differ from what the trainer rank published for them: names the source
    tensor, rank, rows or columns, the target and the sums."""


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(R, C)``: the ``[rows, columns]`` a tensor of ``shape`` is summed as (elements)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def checksum_numel(shape: Sequence[int]) -> int:
    """int64 values of one tensor's checksum: ``R + C``."""
    rows, cols = matrix_shape(shape)
    return rows + cols


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


def tensor_checksum(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A served tensor's checksum: ``[R + C]`` int64, row sums then column sums (written
    into ``out`` when given)."""
    rows, cols = matrix_shape(t.shape)
    x = t.detach().reshape(rows, cols)
    if out is None:
        out = torch.empty(rows + cols, dtype=torch.int64, device=t.device)
    out[:rows] = row_sums(x)
    out[rows:] = col_sums(x)
    return out


def box_kind(op: CopyOp, shape: Sequence[int]) -> tuple[str, int, int, int] | None:
    """How ``op``'s source box can be checked: ``("rows", first, rows, cols)`` (it spans whole
    rows of the source of stored ``shape``: checksum entries ``first..first + rows``),
    ``("cols", first, rows, cols)`` (it spans every row: entries ``first..first + cols``, after
    the rows), or ``None`` (neither, or a source addressed through a view). ``rows, cols``:
    the box as a ``[rows, cols]`` matrix in source order."""
    if op.src_view is not None:
        return None
    n_rows, n_cols = matrix_shape(shape)
    if len(shape) == 0:
        return "rows", 0, 1, 1
    box = op.src_box
    lead, length = box.lengths[:-1], box.lengths[-1]
    if length == n_cols:  # whole rows: consecutive when every leading dim but the first is whole
        if tuple(lead[1:]) != tuple(shape[1:-1]):
            return None
        first = box.offsets[0] * math.prod(shape[1:-1]) if len(shape) > 1 else 0
        return "rows", first, box.numel // n_cols, n_cols
    if tuple(lead) == tuple(shape[:-1]):  # every row, some columns
        return "cols", n_rows + box.offsets[-1], n_rows, length
    return None


def box_sums(op: CopyOp, shape: Sequence[int], data: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
    """``(kind, first, sums)`` of a pulled box (``data`` shaped as ``op.src_box``) as
    :func:`box_kind` says it can be checked (torch arithmetic), or ``None``."""
    kind = box_kind(op, shape)
    if kind is None:
        return None
    what, first, rows, cols = kind
    x = data.reshape(rows, cols)
    return what, first, row_sums(x) if what == "rows" else col_sums(x)


__all__ = ["MODULUS", "ChecksumMismatchError", "box_kind", "box_sums", "checksum_numel", "col_sums", "matrix_shape", "row_sums",
           "tensor_checksum"]
