"""Checksums of many 2-D boxes in one pass: one Triton launch per element width on a GPU.

The sums of :mod:`megarefit.transport.checksum`, computed for a table of boxes compiled once
and run every cycle (a trainer's served tensors at each publish; a receiver's pulled boxes).
Each entry is a strided 2-D view ``x[rows, cols]`` of raw bits (W = 1, 2, 4 or 8 bytes)::

    entry e:  addr, rows, cols, row_stride, col_stride     (elements of W bytes)
              row_out   where its row sums go in ``out`` (-1: none)
              col_out   where its column sums are added (-1: none; ``out`` zeroed first)
              first_row the row weights start at w(first_row)

    program p -> (e, first row r0): for c in 0, BC, 2*BC, ...:
        row_sums[r]  += sum_c w(c) * x[r, c]            (r0 <= r < r0 + BR)
        col_sums[c]  += sum_r w(first_row + r) * x[r, c]    (atomic: int64, wraps)

Every value is an int64 sum of products of integers, so the result equals the torch path
(:func:`~megarefit.transport.checksum.row_sums` / ``col_sums``) bit for bit. Without Triton
or off a GPU the torch path runs instead (``fused=True`` forces the kernel, for tests under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarefit.cuda import kernel_device
from megarefit.transport.checksum import MODULUS, col_sums, row_sums

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

TILE = 4096  # elements per program and column step (BR * BC)
COLUMN_BLOCKS = (16, 256)

if triton is not None:
    @triton.jit
    def _box_sums(progs, addr_a, rows_a, cols_a, rs_a, cs_a, row_out_a, col_out_a, first_a, out,
                  BITS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, MOD: tl.constexpr):
        p = tl.program_id(0)
        e = tl.load(progs + 2 * p)
        r0 = tl.load(progs + 2 * p + 1)
        x_ptr = tl.load(addr_a + e).to(tl.pointer_type(BITS))
        n_rows = tl.load(rows_a + e)
        n_cols = tl.load(cols_a + e)
        rs = tl.load(rs_a + e)
        cs = tl.load(cs_a + e)
        row_out = tl.load(row_out_a + e)
        col_out = tl.load(col_out_a + e)
        first = tl.load(first_a + e)
        r = r0 + tl.arange(0, BR)
        wr = ((first + r) % MOD + 1).to(tl.int64)
        acc = tl.zeros([BR], dtype=tl.int64)
        for c0 in range(0, n_cols, BC):
            c = c0 + tl.arange(0, BC)
            mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
            x = tl.load(x_ptr + r[:, None] * rs + c[None, :] * cs, mask=mask, other=0).to(tl.int64)
            if row_out >= 0:
                acc += tl.sum(x * (c % MOD + 1).to(tl.int64)[None, :], axis=1)
            if col_out >= 0:
                tl.atomic_add(out + col_out + c, tl.sum(x * wr[:, None], axis=0), mask=c < n_cols)
        if row_out >= 0:
            tl.store(out + row_out + r, acc, mask=r < n_rows)

    _BITS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


class BoxSums:
    """Row and column sums of many 2-D views into one int64 ``out``, compiled once.

    ``entries``: ``(x, row_out, col_out, first_row)`` with ``x`` a 2-D view (any strides)
    whose memory stays put; ``row_out`` / ``col_out`` offsets into ``out`` (-1: skip).
    Calling writes the row sums and adds the column sums; it zeroes ``out`` first.
    """

    def __init__(self, entries: Sequence[tuple[torch.Tensor, int, int, int]], out: torch.Tensor,
                 fused: bool | None = None):
        self.entries, self.out = list(entries), out
        if fused is None:
            fused = triton is not None and out.is_cuda
        self._launches: list[tuple] = []
        if not fused or not self.entries:
            return
        groups: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for x, row_out, col_out, first in self.entries:
            rows, cols = x.shape
            bc = COLUMN_BLOCKS[0] if cols <= COLUMN_BLOCKS[0] else COLUMN_BLOCKS[1]
            groups.setdefault((x.element_size(), bc), []).append(
                (x.data_ptr(), rows, cols, x.stride(0), x.stride(1), row_out, col_out, first))
        for (w, bc), rows_ in sorted(groups.items()):
            br = max(1, TILE // bc)
            t = torch.tensor(rows_, dtype=torch.int64)
            blocks = (t[:, 1] + br - 1) // br
            blocks = torch.clamp(blocks, min=1)
            entry = torch.repeat_interleave(torch.arange(len(t)), blocks)
            first = torch.cumsum(blocks, 0) - blocks
            r0 = (torch.arange(len(entry)) - first[entry]) * br
            table = torch.stack([entry, r0], 1).reshape(-1).to(out.device)
            meta = [t[:, k].contiguous().to(out.device) for k in range(8)]
            self._launches.append((len(entry), table, meta, _BITS[w], br, bc))

    @property
    def fused(self) -> bool:
        return bool(self._launches)

    def __call__(self) -> torch.Tensor:
        """Compute every entry's sums into ``out`` (asynchronous on a GPU); returns ``out``."""
        self.out.zero_()
        if self._launches:
            with kernel_device(self.out.device):
                for programs, table, meta, bits, br, bc in self._launches:
                    _box_sums[(programs,)](table, *meta, self.out, BITS=bits, BR=br, BC=bc, MOD=MODULUS,
                                           num_warps=4)
            return self.out
        for x, row_out, col_out, first in self.entries:
            if row_out >= 0:
                self.out[row_out:row_out + x.shape[0]] = row_sums(x)
            if col_out >= 0:
                self.out[col_out:col_out + x.shape[1]] += col_sums(x, first)
        return self.out


__all__ = ["BoxSums"]
