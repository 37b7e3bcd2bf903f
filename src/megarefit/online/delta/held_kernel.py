"""The held arena's fingerprint in one read on a GPU (:mod:`~megarefit.online.delta.held` defines it).

PyTorch has no integer matrix-vector product on CUDA, so its path writes the weighted words to a
temporary and sums them: three passes over the bytes. This kernel reads each word once: program
``c`` sums chunk ``c``'s words ``x_j`` (``j < CHUNK``, masked past the last word) as
``sum_j (2 j + 1) * x_j`` in int64, whose products and sums wrap modulo 2**64 as PyTorch's do.

A device uses it only after :func:`usable` checked it against the PyTorch path on a known input
there (chunks whole and partial); where Triton is missing or the check fails, a warning says so
and the PyTorch path is used.
"""

from __future__ import annotations

import torch

from megarefit.cuda import KernelCheck, kernel_device

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

LANES = 1024  # words each program reads at once
_CHECK = KernelCheck("fused fingerprint", "the held arena is fingerprinted with PyTorch ops")

if triton is not None:
    @triton.jit(do_not_specialize=["n"])
    def _chunk_sums(words, out, n, CHUNK: tl.constexpr, LANE: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([LANE], dtype=tl.int64)
        for a in tl.static_range(0, CHUNK, LANE):
            j = a + tl.arange(0, LANE).to(tl.int64)
            at = c * CHUNK + j
            x = tl.load(words + at, mask=at < n, other=0)
            acc += x * (2 * j + 1)
        tl.store(out + c, tl.sum(acc, axis=0))


def chunk_sums(words: torch.Tensor, chunk: int) -> torch.Tensor:
    """The weighted sums of ``words`` (int64, flat, contiguous) per chunk of ``chunk`` words (a
    multiple of :data:`LANES`): int64 ``[ceil(words / chunk)]``. Asynchronous."""
    out = torch.empty((words.numel() + chunk - 1) // chunk, dtype=torch.int64, device=words.device)
    if out.numel():
        with kernel_device(words.device):
            _chunk_sums[(out.numel(),)](words, out, words.numel(), CHUNK=chunk, LANE=LANES)
    return out


def usable(device: torch.device, reference) -> bool:
    """Whether :func:`chunk_sums` is used on ``device``: checked once against ``reference``
    (``reference(words, chunk)``, the PyTorch path) on 2.5 chunks of random words."""
    if triton is None or device.type != "cuda":
        return False
    return _CHECK(device, lambda d: _sums_right(d, reference))


def _sums_right(device: torch.device, reference) -> bool:
    g = torch.Generator().manual_seed(0)
    chunk = 4 * LANES
    words = torch.randint(-2 ** 62, 2 ** 62, (5 * chunk // 2,), generator=g, dtype=torch.int64).to(device)
    return torch.equal(chunk_sums(words, chunk).cpu(), reference(words, chunk).cpu())


__all__ = ["LANES", "chunk_sums", "usable"]
