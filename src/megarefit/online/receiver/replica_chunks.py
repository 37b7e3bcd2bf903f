"""Cut-through fan-out, as data: a served arena cut into chunks, and the progress record.

A replica forwards its arena chunk by chunk as chunks land (:mod:`~megarefit.online.receiver.replica`).
Its dtype arenas are laid back to back in the order its ``replica_info`` record lists them (the
*served order*); a chunk is a byte range of one dtype arena, and a replica's progress is the
number of bytes of the served order, from its start, that have landed in its arena::

    served order  [ bfloat16 arena ................ | float32 arena ...... ]
    chunks        [ c0      | c1    | c2      | c3  | c4       | c5      ]
                            ^ progress = c1.end: c0 and c1 landed (bytes, not chunks)

A child reads chunk ``c`` once its parent's progress reaches ``c.end``. Each replica cuts its own
chunks (its ``chunk_bytes``): only byte positions in the served order are compared, never chunk
numbers. Nothing here touches torch, NIXL or the store.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from megarefit.errors import MegarefitError

__all__ = ["ABANDONED", "Chunk", "MirrorStats", "format_progress", "parse_progress", "plan_chunks"]

ABANDONED = -1  # progress of a mirror its owner gave up (it fell back or failed): its children fail over


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, start + nbytes)`` of the ``dtype`` arena (byte offsets, not elements);
    ``end``: the byte where the chunk ends in the served order (all dtype arenas back to back)."""

    dtype: str
    start: int
    nbytes: int
    end: int


@dataclass
class MirrorStats:
    """What the last cycle of a replica saw. Bytes, not elements.

    ``chunks``: READs it posted for the version it handed over (one per chunk); ``parent_bytes``:
    the parent's served arenas, back to back; ``first_read_progress``: the parent's progress (bytes
    landed) when this replica posted its first READ of that version: below ``parent_bytes`` means
    it read while its parent was still mirroring (cut-through); ``retries``: attempts abandoned
    because the parent moved to another version or restarted (``StaleVersionError``)."""

    chunks: int = 0
    parent_bytes: int = 0
    first_read_progress: int | None = None
    retries: int = 0


def plan_chunks(arenas: Sequence[tuple[str, int, int]], targets: Sequence[tuple[str, int, int]],
                chunk_bytes: int | None) -> tuple[Chunk, ...]:
    """Cut arenas into chunks of at most ``chunk_bytes`` bytes, in the served order.

    Args:
        arenas: ``(dtype, elements, bytes per element)`` per dtype arena, in the served order.
        targets: ``(dtype, element offset, elements)`` of the targets in those arenas: a chunk ends
            on the last target boundary that fits (a layer's tensors together) where one does, else
            on the last whole element that fits.
        chunk_bytes: the largest chunk in bytes (at least one element is always taken); ``None``:
            one chunk per arena (store-and-forward).

    Raises:
        MegarefitError: ``chunk_bytes`` below 1, or a target outside its arena.
    """
    if chunk_bytes is not None and chunk_bytes < 1:
        raise MegarefitError(f"chunk_bytes must be >= 1 (bytes; None: one chunk per arena), got {chunk_bytes}")
    sizes = {d: (n, e) for d, n, e in arenas}
    ends: dict[str, set[int]] = {d: set() for d in sizes}
    for d, offset, numel in targets:
        if d not in sizes or offset < 0 or offset + numel > sizes[d][0]:
            raise MegarefitError(f"target at elements [{offset}, {offset + numel}) of the {d} arena lies outside "
                                 f"it ({sizes.get(d, (0,))[0]} elements)")
        ends[d].add((offset + numel) * sizes[d][1])
    out: list[Chunk] = []
    base = 0
    for d, numel, esize in arenas:
        total = numel * esize
        bounds = sorted(ends[d] - {0})
        start = 0
        while start < total:
            stop = total if chunk_bytes is None else min(total, start + max(esize, chunk_bytes // esize * esize))
            if stop < total:
                i = bisect.bisect_right(bounds, stop) - 1
                if i >= 0 and bounds[i] > start:
                    stop = bounds[i]
            out.append(Chunk(d, start, stop - start, base + stop))
            start = stop
        base += total
    return tuple(out)


def format_progress(epoch: int, landed: int) -> str:
    """The progress record of a mirror: ``"<epoch> <landed bytes>"`` (``landed`` may be
    :data:`ABANDONED`)."""
    return f"{int(epoch)} {int(landed)}"


def parse_progress(record: bytes | str) -> tuple[int, int]:
    """``(epoch, landed bytes)`` of a progress record written by :func:`format_progress`.

    Raises:
        MegarefitError: not two integers."""
    text = record.decode() if isinstance(record, bytes) else record
    try:
        epoch, landed = (int(x) for x in text.split())
    except ValueError as exc:
        raise MegarefitError(f"malformed replica progress record {text!r}: want '<epoch> <landed bytes>'") from exc
    return epoch, landed
