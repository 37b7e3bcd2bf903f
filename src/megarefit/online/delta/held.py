"""Fingerprints of what a staged receiver holds between cycles: a consumer that writes a tensor
it was handed is seen before a delta patches the arena.

A staged cycle hands the consumer views of the receiver's arena. A delta cycle later patches
only the elements the trainers changed, so the arena must still hold the version it was
fenced with, bit for bit. :class:`HeldFingerprint` takes, when the version is fenced, per
arena (one flat tensor per dtype) and per chunk of :data:`CHUNK` 8-byte words ``x_j`` of its
bytes (a last partial word zero-padded)::

    sum_j (2 j + 1) * x_j   (mod 2**64, j < CHUNK the word's place in its chunk)

The weights are odd, so a change to any one word always changes its chunk's sum, and words
moved within a chunk change it too (rows permuted in place). Computed on the arena's device: on a
GPU by one Triton launch that reads each word once (:mod:`~megarefit.online.delta.held_kernel`), else by
PyTorch ops; benchmarks/bench_held.py measures it (docs/delta.md has the table).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarefit.online.delta.held_kernel import chunk_sums, usable

CHUNK = 4096  # words (8 bytes each) per sum: the fingerprint is 1/4096 of the arena's bytes
BLOCK = 1 << 24  # words weighted at once by the PyTorch path on a GPU (the temporary: 128 MiB)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t``'s bytes (contiguous, 8-byte aligned) as int64 words, flat, and its last partial
    word zero-padded (``None`` when its bytes are whole words)."""
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    if whole == raw.numel():
        return raw.view(torch.int64), None
    tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
    tail[:raw.numel() - whole] = raw[whole:]
    return raw[:whole].view(torch.int64), tail.view(torch.int64)


def weighted_sums(words: torch.Tensor, chunk: int = CHUNK, blocked: bool | None = None) -> torch.Tensor:
    """The PyTorch path: ``sum_j (2 j + 1) * x_j`` per chunk of ``chunk`` words of ``words``
    (int64, flat), the last chunk partial. On a CPU one matrix-vector product; on a GPU (no
    integer matmul; ``blocked``, default: on a GPU) a product and a sum per block of
    :data:`BLOCK` words."""
    weights = torch.arange(1, 2 * chunk, 2, dtype=torch.int64, device=words.device)
    full = words.numel() // chunk * chunk
    chunks = words[:full].view(-1, chunk)
    sums = []
    if full and not (words.is_cuda if blocked is None else blocked):
        sums.append(torch.mv(chunks, weights))
    elif full:
        rows = max(1, BLOCK // chunk)  # (a module global: tests set it small)
        tmp = torch.empty((min(rows, chunks.shape[0]), chunk), dtype=torch.int64, device=words.device)
        for a in range(0, chunks.shape[0], rows):
            part = chunks[a:a + rows]
            out = tmp[:part.shape[0]]
            torch.mul(part, weights, out=out)
            sums.append(out.sum(1))
    if full < words.numel():
        rest = words[full:]
        sums.append((rest * weights[:rest.numel()]).sum().view(1))
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=words.device)


def fingerprint(t: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """The chunk sums of ``t`` (see the module docstring): int64 ``[ceil(words / CHUNK)]`` on
    ``t``'s device. ``t`` must be contiguous and start 8-byte aligned (an arena). ``fused``
    (default: where :func:`~megarefit.online.delta.held_kernel.usable` on ``t``'s device): one Triton
    launch reading each word once, else :func:`weighted_sums`."""
    words, tail = _words(t)
    if fused is None:
        fused = usable(t.device, weighted_sums)
    sums = chunk_sums(words, CHUNK) if fused else weighted_sums(words)
    if tail is None:
        return sums
    at = words.numel()  # the padded last word, at its place in its chunk
    term = tail * (2 * (at % CHUNK) + 1)
    if at // CHUNK == sums.numel():
        return torch.cat([sums, term])
    sums[-1:] += term
    return sums


class HeldFingerprint:
    """The fingerprints of ``arenas`` (by key, e.g. dtype) as they are now; :meth:`changed`
    says which bytes differ later."""

    def __init__(self, arenas: Mapping[str, torch.Tensor]):
        self.arenas = dict(arenas)
        self.sums = {k: fingerprint(a) for k, a in self.arenas.items()}

    def changed(self) -> dict[str, list[tuple[int, int]]]:
        """Per arena whose bytes changed since: the byte ranges ``[start, end)`` of the chunks
        that differ (empty: nothing changed)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for k, a in self.arenas.items():
            now = fingerprint(a)
            differ = (now != self.sums[k]).nonzero().view(-1).tolist()
            if differ:
                nbytes = a.numel() * a.element_size()
                out[k] = [(c * CHUNK * 8, min(nbytes, (c + 1) * CHUNK * 8)) for c in differ]
        return out


def written(changed: Mapping[str, list[tuple[int, int]]], layout: list[tuple[str, str, int, tuple[int, ...]]],
            itemsize: Mapping[str, int]) -> list[str]:
    """The names of ``layout``'s tensors (``(name, dtype, element offset, shape)`` in an arena
    per dtype) that overlap a changed byte range of their arena, in layout order."""
    names = []
    for name, dtype, offset, shape in layout:
        numel = 1
        for s in shape:
            numel *= s
        lo, hi = offset * itemsize[dtype], (offset + numel) * itemsize[dtype]
        if any(a < hi and lo < b for a, b in changed.get(dtype, ())):
            names.append(name)
    return names


__all__ = ["BLOCK", "CHUNK", "HeldFingerprint", "fingerprint", "weighted_sums", "written"]
