"""The held arena's fingerprint in one read on a GPU (:mod:`~megarefit.online.held` defines it).

PyTorch has no integer matrix-vector product on CUDA, so its path writes the weighted words to a
temporary and sums them: three passes over the bytes. This kernel reads each word once: program
``c`` sums chunk ``c``'s words ``x_j`` (``j < CHUNK``, masked past the last word) as
``sum_j (2 j + 1) * x_j`` in int64, whose products and sums wrap modulo 2**64 as PyTorch's do.

A device uses it only after :func:`usable` checked it against the PyTorch path on a known input
there (chunks whole and partial); where Triton is missing or the check fails, a warning says so
and the PyTorch path is used.
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

LANES = 1024  # words each program reads at once
_broken: dict[torch.device, str] = {}  # devices where the kernel failed its check, and why
_checked: set[torch.device] = set()  # devices where it passed

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
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device in _checked or device in _broken:
        return device in _checked
    try:
        g = torch.Generator().manual_seed(0)
        chunk = 4 * LANES
        words = torch.randint(-2 ** 62, 2 ** 62, (5 * chunk // 2,), generator=g, dtype=torch.int64).to(device)
        if not torch.equal(chunk_sums(words, chunk).cpu(), reference(words, chunk).cpu()):
            raise RuntimeError("known sums came out wrong")
    except Exception as exc:  # Triton imports but cannot compile or run here: the PyTorch path instead
        _broken[device] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"megarefit: the fused fingerprint is not used on {device} ({_broken[device][:200]}); "
                      "the held arena is fingerprinted with PyTorch ops", stacklevel=2)
        return False
    _checked.add(device)
    return True


__all__ = ["LANES", "chunk_sums", "usable"]
