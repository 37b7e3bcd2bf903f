"""Delta records: what a trainer rank publishes about one version's changed elements.

A delta refit (:mod:`~megarefit.online.delta.log` on the trainer,
:mod:`~megarefit.online.delta.apply` on the receiver) moves only the elements of the served
tensors that changed between two published versions. Per version and rank the trainer packs,
into one of ``keep`` registered slot buffers, one **segment** per changed tensor, and publishes
one signed record under ``delta/<tp>.<pp>.<ep>/<epoch>/<version>`` (:func:`delta_key`; the epoch:
:func:`epoch_key`)::

    record   b"MRD1" | int64 header [version, base, addr, capacity, used, mem, dev, rows]
             | int64 rows x [entry, format, count, offset, nbytes]

* ``base``: the version the delta starts from (the rank's previous published version);
* ``addr`` / ``capacity`` / ``used``: the slot's address in the trainer's registered memory,
  its size and the bytes this version's segments fill (bytes); ``mem``: 0 host, 1 GPU;
* a row per tensor with at least one changed element: ``entry``, its index in the rank's
  manifest (``Manifest.tensors``); ``format``: how the changed elements are named --
  :data:`INDICES` (``count`` int32 flat element indices, ascending), :data:`BITMAP`
  (``ceil(numel / 8)`` bytes, bit ``j`` of byte ``b`` set when element ``8 b + j`` changed) or
  :data:`PAGED` (pages of 65536 elements: ``ceil(numel / 65536)`` int32 counts, then ``count``
  16-bit offsets within their page, ascending) -- then, 8-aligned, ``count`` values in the
  entry's dtype;
  ``offset`` / ``nbytes``: where the segment lies in the slot (bytes, 8-aligned).

Records are parsed as fixed-width integers and checked (never unpickled):
:func:`decode_record` raises :class:`DeltaRecordError` naming the field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord

MAGIC = b"MRD1"
INDICES = 0  # int32 flat element indices, ascending
BITMAP = 1  # one bit per element, little-endian within each byte
PAGED = 2  # int32 changed count per page of PAGE elements, then 16-bit offsets within the page
FORMATS = {INDICES: "indices", BITMAP: "bitmap", PAGED: "paged"}
PAGE = 1 << 16
_HEADER = 8
_ROW = 5
_MAX_ROWS = 1 << 24


class DeltaRecordError(MegarefitError):
    """A published delta record is malformed (names the field)."""


@dataclass(frozen=True)
class DeltaSegment:
    """One changed tensor of a version: manifest entry index, :data:`FORMATS` code, changed
    elements, and the segment's byte offset and length in the slot."""

    entry: int
    format: int
    count: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class DeltaRecord:
    """One rank's delta from version ``base`` to ``version`` (see the module docstring):
    the slot's registered bytes (``addr``, ``capacity``, ``used``; NIXL memory ``mem``, ``dev``)
    and its segments, by manifest entry."""

    version: int
    base: int
    addr: int
    capacity: int
    used: int
    mem: str
    dev: int
    segments: tuple[DeltaSegment, ...]

    def encode(self) -> bytes:
        """The record's bytes (the module docstring's layout)."""
        head = (self.version, self.base, self.addr, self.capacity, self.used, int(self.mem == "VRAM"), self.dev,
                len(self.segments))
        rows = [x for s in self.segments for x in (s.entry, s.format, s.count, s.offset, s.nbytes)]
        return MAGIC + struct.pack(f"<{_HEADER + len(rows)}q", *head, *rows)


def mask_bytes(fmt: int, count: int, numel: int) -> int:
    """Bytes naming ``count`` changed of ``numel`` elements in format ``fmt``."""
    if fmt == INDICES:
        return 4 * count
    if fmt == PAGED:
        return 4 * ((numel + PAGE - 1) // PAGE) + 2 * count
    return (numel + 7) // 8


def segment_bytes(fmt: int, count: int, numel: int, itemsize: int) -> int:
    """Bytes of one segment (``count`` of ``numel`` elements changed, values of ``itemsize``
    bytes), rounded up to 8 so the next segment stays aligned."""
    return _align(_align(mask_bytes(fmt, count, numel)) + count * itemsize)


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def best_format(count: int, numel: int) -> int:
    """The format naming ``count`` changed of ``numel`` elements in the fewest bytes: int32
    indices when very sparse, 16-bit offsets in pages (about 2 bytes per change) in between,
    the bitmap above one element in 16 changed; int32 indices only below 2**31 elements."""
    formats = [BITMAP, PAGED] + ([INDICES] if numel < 1 << 31 else [])
    return min(formats, key=lambda f: (mask_bytes(f, count, numel), f))


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise DeltaRecordError(f"malformed delta record: {what}")


def decode_record(payload: bytes) -> DeltaRecord:
    """The :class:`DeltaRecord` in ``payload`` (an authenticated record's bytes), checked.

    Raises:
        DeltaRecordError: wrong magic or length, negative fields, a segment outside ``used``,
            or ``used`` beyond ``capacity``."""
    _check(payload[:4] == MAGIC, "wrong magic")
    body = payload[4:]
    _check(len(body) >= 8 * _HEADER and len(body) % 8 == 0, f"length {len(payload)}")
    head = struct.unpack_from(f"<{_HEADER}q", body)
    version, base, addr, capacity, used, mem, dev, n = head
    _check(0 <= n <= _MAX_ROWS and len(body) == 8 * (_HEADER + _ROW * n), f"{n} rows in {len(payload)} bytes")
    _check(min(head) >= 0 and mem in (0, 1) and used <= capacity, f"header {head}")
    rows = struct.unpack_from(f"<{_ROW * n}q", body, 8 * _HEADER)
    segments = tuple(DeltaSegment(*rows[i:i + _ROW]) for i in range(0, len(rows), _ROW))
    for s in segments:
        _check(s.format in FORMATS and min(s.entry, s.count, s.offset, s.nbytes) >= 0
               and s.offset % 8 == 0 and s.offset + s.nbytes <= used, f"segment {s}")
    return DeltaRecord(version, base, addr, capacity, used, "VRAM" if mem else "DRAM", dev, segments)


def _rank(rank: RankCoord) -> str:
    """``tp.pp.ep`` (``.copy`` past the first copy), as the rendezvous spells ranks."""
    return f"{rank.tp}.{rank.pp}.{rank.ep}" + (f".{rank.copy}" if rank.copy else "")


def epoch_key(rank: RankCoord) -> str:
    """The rendezvous key of ``rank``'s delta epoch: a random text each trainer process's
    :class:`~megarefit.online.delta.log.DeltaLog` writes when it starts, so records of a process
    that was restarted are never chained with the new one's."""
    return f"delta/{_rank(rank)}/epoch"


def delta_key(rank: RankCoord, epoch: str, version: int) -> str:
    """The rendezvous key (relative to the job prefix) of ``rank``'s delta into ``version``,
    written in delta epoch ``epoch``."""
    return f"delta/{_rank(rank)}/{epoch}/{int(version)}"


__all__ = ["BITMAP", "FORMATS", "INDICES", "PAGE", "PAGED", "DeltaRecord", "DeltaRecordError", "DeltaSegment",
           "best_format", "decode_record", "delta_key", "epoch_key", "mask_bytes", "segment_bytes"]
