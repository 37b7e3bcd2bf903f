"""Many small strided copies as one batch: one Triton launch per word size on a GPU.

A receiver places the bytes it pulled into scratch (row-parallel boxes, FP8 scale
columns, small pulls gathered into one READ) with thousands of copies per cycle. One
``copy_`` per pair costs a kernel launch each (measured on an H200: 4128 strided FP8
boxes of Qwen3-30B-A3B etp=2, 19.7 ms through ``torch._foreach_copy_``, which takes the
one-kernel-per-tensor path for strided tensors). :class:`BoxCopies` compiles the pairs
once into a table of 2-D boxes::

    entry e:  dst_addr, src_addr           bytes (device pointers)
              rows, cols                   cols in words of W bytes (W = 8, 4, 2 or 1:
              dst_stride, src_stride       the widest word dividing every address,
                                           length and row stride of the entry)

    program p -> (e, first row):   for c in 0, BC, 2*BC, ...:
                                      dst[r, c:c+BC] = src[r, c:c+BC]   for BR rows r

A pair's dims are first collapsed where both sides are contiguous across them (a whole
contiguous run becomes rows of ``ROW_BYTES``); a box that keeps more than two dims after
that (e.g. ``[experts, rows, cols]`` with a gap between experts) becomes one entry per
leading index. Entries are grouped by (word, column block) so short rows (a scale row
of three floats) do not pay for wide ones. Pairs whose last dim is not contiguous (the
transposed legacy GroupedMLP copies) and CPU tensors take ``copy_`` one by one (torch's
tiled transpose: a one-element-per-step Triton path for transposed boxes was tried and
measured slower on an H200, Qwen3-30B-A3B legacy GroupedMLP 80 ms vs 48 ms per cycle).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from megarefit.cuda import kernel_device
from megarefit.transport.local import BOX_WORD, widened

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

ROW_BYTES = 4096  # a contiguous run is copied as rows of this many bytes
TILE_WORDS = 4096  # words per program and column step (BR * BC)
COLUMN_BLOCKS = (4, 32, 256)  # words per column step: few kernel variants (each compiled once per process)

if triton is not None:
    @triton.jit
    def _copy_boxes(progs, dst_addr, src_addr, rows_a, cols_a, dst_strides, src_strides,
                    WORD: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        p = tl.program_id(0)
        e = tl.load(progs + 2 * p)
        r0 = tl.load(progs + 2 * p + 1)
        dst = tl.load(dst_addr + e).to(tl.pointer_type(WORD))
        src = tl.load(src_addr + e).to(tl.pointer_type(WORD))
        n_rows = tl.load(rows_a + e)
        n_cols = tl.load(cols_a + e)
        ds = tl.load(dst_strides + e)
        ss = tl.load(src_strides + e)
        r = r0 + tl.arange(0, BR)
        for c0 in range(0, n_cols, BC):
            c = c0 + tl.arange(0, BC)
            mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
            x = tl.load(src + r[:, None] * ss + c[None, :], mask=mask)
            tl.store(dst + r[:, None] * ds + c[None, :], x, mask=mask)

    _WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def _collapse(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Drop size-1 dims and merge neighbours contiguous on both sides (strides in bytes)."""
    dims = [(n, x, y) for n, x, y in zip(shape, a, b) if n != 1]
    out: list[list[int]] = []
    for n, x, y in reversed(dims):
        if out and x == out[-1][1] * out[-1][0] and y == out[-1][2] * out[-1][0]:
            out[-1] = [out[-1][0] * n, out[-1][1], out[-1][2]]
        else:
            out.append([n, x, y])
    out.reverse()
    return [d[0] for d in out], [d[1] for d in out], [d[2] for d in out]


def box_entries(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[int, int, int, int, int, int]] | None:
    """``(dst_addr, src_addr, rows, row_bytes, dst_stride_bytes, src_stride_bytes)`` boxes
    that copy ``src`` into ``dst`` (same shape and dtype), or ``None`` if a last dim is
    not contiguous. Rows of one entry never overlap each other on the destination."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"box copy of {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    if dst.numel() == 0:
        return []
    item = dst.element_size()
    shape, ds, ss = _collapse(dst.shape, [s * item for s in dst.stride()], [s * item for s in src.stride()])
    if not shape:  # a single element
        shape, ds, ss = [1], [item], [item]
    if (ds[-1] != item or ss[-1] != item) and dst.shape[-1] == 1:  # a column: rows of one element
        shape, ds, ss = shape + [1], ds + [item], ss + [item]
    if ds[-1] != item or ss[-1] != item:
        return None
    cols = shape[-1] * item
    d0, s0 = dst.data_ptr(), src.data_ptr()
    if len(shape) == 1:  # one contiguous run: rows of ROW_BYTES plus a tail
        full, tail = divmod(cols, ROW_BYTES)
        out = [(d0, s0, full, ROW_BYTES, ROW_BYTES, ROW_BYTES)] if full else []
        if tail:
            out.append((d0 + full * ROW_BYTES, s0 + full * ROW_BYTES, 1, tail, tail, tail))
        return out
    rows, dr, sr = shape[-2], ds[-2], ss[-2]
    out = []
    for index in itertools.product(*(range(n) for n in shape[:-2])):
        off_d = sum(i * st for i, st in zip(index, ds))
        off_s = sum(i * st for i, st in zip(index, ss))
        out.append((d0 + off_d, s0 + off_s, rows, cols, dr, sr))
    return out


def _word(entry: tuple[int, ...]) -> int:
    d, s, _, cols, dr, sr = entry
    for w in (8, 4, 2):
        if not (d % w or s % w or cols % w or dr % w or sr % w):
            return w
    return 1


def stacked(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs`` with every run of like pairs (same dtype, shape and strides on each side,
    each in one storage) whose destinations and sources advance by constant steps merged
    into one pair with a leading dim: the same elements, one ``copy_`` instead of many::

        expert j:  dst = arena[a + j*D : ...] (F, h)      src = scratch[b + j*S : ...].T (F, h)
        ->         dst = arena.as_strided((E, F, h), (D, h, 1), a)
                   src = scratch.as_strided((E, F, h), (S, 1, 2F), b)

    Legacy GroupedMLP experts (transposed boxes, one per expert) are the case this is for."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for d, s in pairs:
        key = (d.dtype, tuple(d.shape), d.stride(), s.stride(), d.untyped_storage().data_ptr(),
               s.untyped_storage().data_ptr())
        groups.setdefault(key, []).append((d, s))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in groups.values():
        group.sort(key=lambda p: p[0].data_ptr())
        i = 0
        while i < len(group):
            j = i + 1
            if j < len(group):
                dd = group[j][0].storage_offset() - group[i][0].storage_offset()
                ds = group[j][1].storage_offset() - group[i][1].storage_offset()
                while (j + 1 < len(group) and group[j + 1][0].storage_offset() - group[j][0].storage_offset() == dd
                       and group[j + 1][1].storage_offset() - group[j][1].storage_offset() == ds):
                    j += 1
                j += 1
                d0, s0 = group[i]
                if j - i > 1 and dd > 0 and ds >= 0 and _disjoint_runs(d0, dd):
                    out.append((d0.as_strided((j - i, *d0.shape), (dd, *d0.stride()), d0.storage_offset()),
                                s0.as_strided((j - i, *s0.shape), (ds, *s0.stride()), s0.storage_offset())))
                    i = j
                    continue
            out.append(group[i])
            i += 1
    return out


def _disjoint_runs(d: torch.Tensor, step: int) -> bool:
    """Copies of ``d`` shifted by ``step`` elements never overlap: ``step`` exceeds its extent."""
    extent = 1 + sum((n - 1) * st for n, st in zip(d.shape, d.stride()))
    return step >= extent


def warm_up_pairs(buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) views of a 64 KiB uint8 ``buf`` that use every kernel variant once: rows
    of b words of w bytes (b in :data:`COLUMN_BLOCKS`, w = 1, 2, 4, 8) starting w-aligned only."""
    pairs = []
    for w in (1, 2, 4, 8):
        for b in COLUMN_BLOCKS:
            n = b * w
            pairs.append((buf[32768 + w: 32768 + w + 4 * n].view(2, 2 * n)[:, :n], buf[w: w + 4 * n].view(2, 2 * n)[:, :n]))
    return pairs


class BoxCopies:
    """``dst.copy_(src)`` for every pair, compiled once and run many times.

    ``pairs`` are views whose memory stays put (scratch slots and target buffers). On a
    GPU with Triton each call is a handful of launches (one per word size and column
    block, see the module docstring), asynchronous on the current stream; otherwise a
    loop of ``copy_``. ``fused=True`` forces the kernel (CPU tensors under
    ``TRITON_INTERPRET=1``, for tests).
    """

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], fused: bool | None = None):
        self.pairs = list(pairs)
        if fused is None:
            fused = triton is not None and bool(self.pairs) and self.pairs[0][0].is_cuda
        self._rest: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._launches: list[tuple] = []
        self.device = self.pairs[0][0].device if self.pairs else torch.device("cpu")
        if not fused:  # CPU: copy_ (regular runs of pairs as one), as wide words where both sides allow
            self._rest = [widened(d, s, BOX_WORD) for d, s in stacked(self.pairs)]
            return
        groups: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for dst, src in self.pairs:
            entries = box_entries(dst, src)
            if entries is None:
                self._rest.append((dst, src))
                continue
            for e in entries:
                w = _word(e)
                bc = next(b for b in COLUMN_BLOCKS if b >= e[3] // w or b == COLUMN_BLOCKS[-1])
                groups.setdefault((w, bc), []).append(e)
        self._rest = stacked(self._rest)  # e.g. one transposed copy per run of evenly spaced experts
        device = self.pairs[0][0].device
        for (w, bc), entries in sorted(groups.items()):
            br = max(1, TILE_WORDS // bc)
            t = torch.tensor(entries, dtype=torch.int64)  # [entries, 6]
            t[:, 3:] //= w  # columns and row strides in words
            blocks = (t[:, 2] + br - 1) // br  # programs per entry (>= 1)
            first = torch.cumsum(blocks, 0) - blocks
            marks = torch.zeros(int(blocks.sum()), dtype=torch.int64)
            marks.index_add_(0, first[1:], torch.ones(len(first) - 1, dtype=torch.int64))
            entry = torch.cumsum(marks, 0)  # each program's entry
            r0 = (torch.arange(len(entry)) - first[entry]) * br
            table = torch.stack([entry, r0], 1).reshape(-1).to(device)
            meta = [t[:, k].contiguous().to(device) for k in range(6)]
            self._launches.append((len(entry), table, meta, _WORDS[w], br, bc))

    @property
    def fused(self) -> bool:
        return bool(self._launches)

    @classmethod
    def warm_up(cls, device: torch.device | str) -> None:
        """Compile (or load from Triton's cache) every kernel variant on ``device`` now, so a
        receiver's first refit does not pay Triton's start-up (~2 s in a fresh process on an
        H200 host: driver, cache key, launcher build). No-op without Triton or off a GPU."""
        device = torch.device(device)
        if triton is None or device.type != "cuda":
            return
        pairs = warm_up_pairs(torch.zeros(1 << 16, dtype=torch.uint8, device=device))
        cls(pairs, fused=True)()
        torch.cuda.synchronize(device)

    def __call__(self) -> None:
        """Launch the copies on the current stream of the pairs' device (made the current device
        for the launches: Triton addresses the current device's memory, whatever the caller's is)."""
        with kernel_device(self.device):
            for programs, table, meta, word, br, bc in self._launches:
                _copy_boxes[(programs,)](table, *meta, WORD=word, BR=br, BC=bc, num_warps=4)
        for dst, src in self._rest:
            dst.copy_(src)


__all__ = ["COLUMN_BLOCKS", "BoxCopies", "box_entries", "stacked", "warm_up_pairs"]
