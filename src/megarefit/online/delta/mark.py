"""One fused launch per parameter on a GPU for :mod:`~megarefit.online.delta.track`: cast the new
values to the parameter's dtype, compare their bits with the old ones, OR the changes into the
parameter's bitmap (and, for ``ChangeTracker.copy_``, write the new values), in one pass.

Each program owns ``BLOCK`` consecutive elements of the parameter starting at a multiple of 8
(so whole bitmap bytes: no two programs write one byte), of which those in ``[start, start + n)``
are the copy's::

    new      = source[e - start].to(param dtype)          (round to nearest even, as Tensor.copy_)
    changed  = bits(new) != bits(param[e])  or  source[e - start] is NaN (its payload may round
               differently from PyTorch's: marked, never missed)
    bitmap[e // 8] |= sum over the byte's 8 elements of changed << (e % 8)
    COPY:    param[e] = new

The PyTorch path in delta_track does the same in about eight launches per chunk; this one reads
the source and the parameter once. :func:`check` compares it with an independent PyTorch
computation once per device and dtype pair; where it differs, or Triton cannot run, a warning
says so and the PyTorch path is used.
"""

from __future__ import annotations

import warnings

import torch

from megarefit.cuda import kernel_device

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

BLOCK = 4096  # elements per program (a multiple of 8)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_checked: dict[tuple, bool] = {}  # (device, param dtype, source dtype) -> whether the kernel is used

if triton is not None:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit(do_not_specialize=["start", "n", "first"])
    def _mark(param, source, bitmap, start, n, first, DTYPE: tl.constexpr, BITS: tl.constexpr, COPY: tl.constexpr,
              BLOCK_SIZE: tl.constexpr):
        e = first + tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = (e >= start) & (e < start + n)
        src = tl.load(source + (e - start), mask=inside, other=0.0)
        new = src.to(DTYPE)
        old = tl.load(param + e, mask=inside, other=0.0)
        changed = inside & ((new.to(BITS, bitcast=True) != old.to(BITS, bitcast=True)) | (src != src))
        if COPY:
            tl.store(param + e, new, mask=inside)
        flags = tl.reshape(changed.to(tl.uint8), [BLOCK_SIZE // 8, 8])
        byte = tl.sum(flags << tl.arange(0, 8).to(tl.uint8)[None, :], axis=1).to(tl.uint8)
        at = tl.min(tl.reshape(e // 8, [BLOCK_SIZE // 8, 8]), axis=1)  # each row: one byte's 8 elements
        valid = at * 8 < start + n
        tl.store(bitmap + at, tl.load(bitmap + at, mask=valid, other=0) | byte, mask=valid)


def usable(param: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether the fused mark runs for a copy of ``source`` into ``param``: both on one GPU, the
    parameter bf16, fp16 or fp32, the source floating point and contiguous, and the kernel checked
    there (:func:`check`, once per device and dtype pair)."""
    if triton is None or not param.is_cuda or source.device != param.device or not source.is_contiguous():
        return False
    if param.dtype not in _TL or source.dtype not in _TL:
        return False
    key = (param.device, param.dtype, source.dtype)
    if key not in _checked:
        _checked[key] = check(*key)
    return _checked[key]


def mark(param: torch.Tensor, source: torch.Tensor, bitmap: torch.Tensor, start: int, copy: bool) -> None:
    """OR into ``bitmap`` (uint8, the parameter's, bit ``j`` of byte ``b`` = element ``8 b + j``)
    the elements ``start .. start + source.numel()`` of flat ``param`` whose bits
    ``source.to(param.dtype)`` changes; with ``copy``, also write them. Asynchronous."""
    n = source.numel()
    if n == 0:
        return
    first = start - start % 8
    grid = (triton.cdiv(start + n - first, BLOCK),)
    with kernel_device(param.device):
        _mark[grid](param.detach().view(-1), source.detach().view(-1), bitmap, start, n, first,
                    DTYPE=_TL[param.dtype], BITS=tl.int32 if param.element_size() == 4 else tl.int16, COPY=copy,
                    BLOCK_SIZE=BLOCK)


def check(device: torch.device, dtype: torch.dtype, source_dtype: torch.dtype) -> bool:
    """Run the fused mark on ``device`` against an independent PyTorch computation (an unaligned
    start, bits set before, -0.0, NaN, values that round to the old ones, copy on and off);
    whether it agrees. A failure warns and returns ``False``."""
    try:
        g = torch.Generator().manual_seed(0)
        numel, start, n = 3 * BLOCK + 37, 13, 2 * BLOCK + 5
        param = (torch.randn(numel, generator=g) * 0.02).to(dtype)
        source = param[start:start + n].to(source_dtype).clone()
        moved = torch.rand(n, generator=g) < 0.3
        source[moved] += (torch.randn(int(moved.sum()), generator=g) * 1e-3).to(source_dtype)
        source[7], source[8] = -0.0, float("nan")
        bits_before = torch.zeros((numel + 7) // 8, dtype=torch.uint8)
        bits_before[5] = 0b10100001
        changed = param[start:start + n].view(_INT[param.element_size()]) != source.to(dtype).view(
            _INT[param.element_size()])
        changed |= source.isnan()
        want = torch.zeros(numel, dtype=torch.bool)
        want[start:start + n] = changed
        for copy in (False, True):
            p, bm = param.to(device), bits_before.to(device)
            mark(p, source.to(device), bm, start, copy)
            flags = ((bm.cpu()[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)[:numel].bool()
            before = ((bits_before[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)[:numel].bool()
            expect = param.clone()
            if copy:
                expect[start:start + n] = source.to(dtype)
            got, nan = p.cpu(), expect.isnan()  # a NaN's payload is the device's own (PyTorch's differs by device)
            wrong_bits = int((~nan & (got.view(_INT[param.element_size()]) != expect.view(_INT[param.element_size()])))
                             .sum()) + int((nan & ~got.isnan()).sum())
            if not torch.equal(flags, want | before) or wrong_bits:
                raise RuntimeError(f"a known answer came out wrong (copy={copy}): {int((flags != (want | before)).sum())} "
                                   f"marks and {wrong_bits} written elements differ")
        return True
    except Exception as exc:  # Triton imports but cannot compile or run here: the PyTorch path instead
        warnings.warn(f"megarefit: the fused change marking is not used on {device} for {source_dtype} -> {dtype} "
                      f"({type(exc).__name__}: {str(exc)[:200]}); changes are found with PyTorch ops", stacklevel=3)
        return False


__all__ = ["BLOCK", "check", "mark", "usable"]
