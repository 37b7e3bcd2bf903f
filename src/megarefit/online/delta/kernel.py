"""One fused launch per delta segment on a GPU: decode the changed elements' names (int32
indices, or 16-bit offsets in pages), find each element's contiguous run, write its value into
the arena. The PyTorch path (:mod:`~megarefit.online.delta.apply`) takes about twenty launches per
tensor; this one takes three (two for the pages' exclusive prefix sum, one kernel), with no host
synchronization.

Each program places ``BLOCK`` changed elements ``j``:

    paged    page p = the last page whose exclusive prefix count is <= j (a binary search over
             the pages), element = p * PAGE + offset[j]
    indices  element = index[j]
    run      k = the last run whose first source element is <= element (a binary search over the
             runs), written when element < end[k], at dst[k] + element - start[k] of the root
"""

from __future__ import annotations

import torch

from megarefit.cuda import KernelCheck, kernel_device
from megarefit.online.delta.records import PAGE

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

BLOCK = 1024
STEPS = 20  # binary-search steps: up to 2**20 pages (2**36 elements) or runs
MAX_RUNS = 1 << STEPS
_CHECK = KernelCheck("fused delta placing", "deltas are placed with PyTorch ops")

if triton is not None:
    @triton.jit
    def _last_at_most(table, n, x, m, BLOCK_SIZE: tl.constexpr, N_STEPS: tl.constexpr):
        """Per lane, the last index i in [0, n) with table[i] <= x (a binary search; 0 if none)."""
        lo = tl.zeros([BLOCK_SIZE], dtype=tl.int64)
        hi = tl.zeros([BLOCK_SIZE], dtype=tl.int64) + n
        for _ in tl.static_range(N_STEPS):
            active = (hi - lo) > 1
            mid = (lo + hi) // 2
            up = active & (tl.load(table + mid, mask=m & active, other=0) <= x)
            lo = tl.where(up, mid, lo)
            hi = tl.where(active & ~up, mid, hi)
        return lo

    @triton.jit(do_not_specialize=["pages", "count", "runs"])  # one compile per dtype, not per size
    def _place(names, cum, pages, count, values, starts, ends, dst, runs, root,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_STEPS: tl.constexpr):
        j = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        m = j < count
        if PAGED:
            page = _last_at_most(cum, pages, j, m, BLOCK_SIZE, N_STEPS)
            element = page * PAGE_SIZE + (tl.load(names + j, mask=m, other=0).to(tl.int64) & (PAGE_SIZE - 1))
        else:
            element = tl.load(names + j, mask=m, other=0).to(tl.int64)
        k = _last_at_most(starts, runs, element, m, BLOCK_SIZE, N_STEPS)
        start = tl.load(starts + k, mask=m, other=0)
        ok = m & (element >= start) & (element < tl.load(ends + k, mask=m, other=0))
        at = tl.load(dst + k, mask=m, other=0) + element - start
        tl.store(root + at, tl.load(values + j, mask=m), mask=ok)


def warm_up(device: torch.device) -> bool:
    """Compile the fused placing for each name format and value width on ``device`` and check
    each on a known answer, so the first delta cycle neither pays for the compile nor trusts a
    kernel that does not place correctly here; whether the fused placing is used on ``device``.
    Anything else (no Triton, a CPU, a failed compile or a wrong answer, with a warning naming
    it) leaves that device to the PyTorch ops."""
    if triton is None or device.type != "cuda":
        return False
    return _CHECK(device, _places_right)


def _places_right(device: torch.device) -> bool:
    return all(_placed_right(device, bits, paged) for bits in (torch.uint8, torch.int16, torch.int32)
               for paged in (False, True))


def _placed_right(device: torch.device, bits: torch.dtype, paged: bool) -> bool:
    """Place 3 known elements (one outside every run) and compare with the answer."""
    idx = torch.tensor([1, 5, PAGE + 2], device=device)
    values = torch.tensor([7, 9, 11], dtype=bits, device=device)
    starts, ends, dst = (torch.tensor(x, device=device) for x in ([0, PAGE], [4, PAGE + 8], [10, 0]))
    root = torch.zeros(16, dtype=bits, device=device)
    if paged:
        counts = torch.tensor([2, 1], dtype=torch.int32, device=device)
        place((idx % PAGE).to(torch.int16), counts, values, starts, ends, dst, root)
    else:
        place(idx.to(torch.int32), None, values, starts, ends, dst, root)
    torch.cuda.synchronize(device)
    want = torch.zeros(16, dtype=bits)
    want[11], want[2] = 7, 11  # element 5 lies in no run
    return torch.equal(root.cpu(), want)


def fused(device: torch.device) -> bool:
    """Whether deltas are placed by the fused kernel on ``device`` (checked by :func:`warm_up`)."""
    return device in _CHECK.passed


def place(names: torch.Tensor, pages: torch.Tensor | None, values: torch.Tensor, starts: torch.Tensor,
          ends: torch.Tensor, dst: torch.Tensor, root: torch.Tensor) -> None:
    """Write ``values`` into ``root`` (flat, the values' dtype) at the changed elements named by
    ``names`` (int32 indices; with ``pages``, the int32 changed counts per page of
    :data:`~megarefit.online.delta.records.PAGE` elements, int16 offsets within them), each
    through its run (``starts`` / ``ends``: source elements, ``dst``: the run's first element in
    ``root``; int64, sorted by start). Asynchronous; every tensor on one GPU."""
    count = values.numel()
    if count == 0:
        return
    if pages is not None:
        counts = pages.to(torch.int64)
        cum = torch.cumsum(counts, 0) - counts
        n_pages = counts.numel()
    else:
        cum, n_pages = starts, 0  # unused
    with kernel_device(root.device):
        _place[(triton.cdiv(count, BLOCK),)](names, cum, n_pages, count, values, starts, ends, dst, starts.numel(),
                                            root, PAGED=pages is not None, PAGE_SIZE=PAGE, BLOCK_SIZE=BLOCK,
                                            N_STEPS=STEPS)


__all__ = ["BLOCK", "MAX_RUNS", "fused", "place", "warm_up"]
