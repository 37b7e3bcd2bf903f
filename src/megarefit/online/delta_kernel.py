"""One fused launch per delta segment on a GPU: decode the changed elements' names (int32
indices, or 16-bit offsets in pages), find each element's contiguous run, write its value into
the arena. The PyTorch path (:mod:`~megarefit.online.delta_apply`) takes about twenty launches per
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

from megarefit.cuda import kernel_device
from megarefit.online.delta_records import PAGE

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

BLOCK = 1024
STEPS = 20  # binary-search steps: up to 2**20 pages (2**36 elements) or runs

if triton is not None:
    @triton.jit(do_not_specialize=["pages", "count", "runs"])  # one compile per dtype, not per size
    def _place(names, cum, pages, count, values, starts, ends, dst, runs, root,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_STEPS: tl.constexpr):
        j = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        m = j < count
        if PAGED:
            lo = tl.zeros([BLOCK_SIZE], dtype=tl.int64)
            hi = tl.full([BLOCK_SIZE], pages, dtype=tl.int64)
            for _ in tl.static_range(N_STEPS):
                active = (hi - lo) > 1
                mid = (lo + hi) // 2
                c = tl.load(cum + mid, mask=m & active, other=0)
                up = active & (c <= j)
                lo = tl.where(up, mid, lo)
                hi = tl.where(active & ~up, mid, hi)
            element = lo * PAGE_SIZE + (tl.load(names + j, mask=m, other=0).to(tl.int64) & (PAGE_SIZE - 1))
        else:
            element = tl.load(names + j, mask=m, other=0).to(tl.int64)
        lo = tl.zeros([BLOCK_SIZE], dtype=tl.int64)
        hi = tl.full([BLOCK_SIZE], runs, dtype=tl.int64)
        for _ in tl.static_range(N_STEPS):
            active = (hi - lo) > 1
            mid = (lo + hi) // 2
            s = tl.load(starts + mid, mask=m & active, other=0)
            up = active & (s <= element)
            lo = tl.where(up, mid, lo)
            hi = tl.where(active & ~up, mid, hi)
        start = tl.load(starts + lo, mask=m, other=0)
        ok = m & (element >= start) & (element < tl.load(ends + lo, mask=m, other=0))
        at = tl.load(dst + lo, mask=m, other=0) + element - start
        tl.store(root + at, tl.load(values + j, mask=m), mask=ok)


def warm_up(device: torch.device) -> None:
    """Compile the fused placing for each name format and value width on ``device`` (a GPU;
    nothing elsewhere), so the first delta cycle does not pay for it."""
    if triton is None or device.type != "cuda":
        return
    run = torch.zeros(1, dtype=torch.int64, device=device)
    for bits in (torch.uint8, torch.int16, torch.int32):
        values = torch.zeros(1, dtype=bits, device=device)
        for names, pages in ((torch.zeros(1, dtype=torch.int32, device=device), None),
                             (torch.zeros(1, dtype=torch.int16, device=device),
                              torch.ones(1, dtype=torch.int32, device=device))):
            place(names, pages, values, run, run + 1, run, torch.zeros(1, dtype=bits, device=device))


def fused() -> bool:
    """Whether the fused placing is available (Triton imported)."""
    return triton is not None


def place(names: torch.Tensor, pages: torch.Tensor | None, values: torch.Tensor, starts: torch.Tensor,
          ends: torch.Tensor, dst: torch.Tensor, root: torch.Tensor) -> None:
    """Write ``values`` into ``root`` (flat, the values' dtype) at the changed elements named by
    ``names`` (int32 indices; with ``pages``, the int32 changed counts per page of
    :data:`~megarefit.online.delta_records.PAGE` elements, int16 offsets within them), each
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


__all__ = ["BLOCK", "fused", "place", "warm_up"]
