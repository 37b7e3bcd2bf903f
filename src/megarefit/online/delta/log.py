"""The trainer side of delta refits: find what changed since the last published version,
pack it into registered slots, publish a signed record per version.

``Publisher(..., delta=True)`` keeps a :class:`DeltaLog` over the tensors it serves (live
parameters, snapshot copies or FP8 buffers and scales; byte for byte what receivers read)::

    tracker  (``Publisher(..., tracker=track_changes(optimizer))``, delta_track): a served tensor
             that holds a tracked parameter bit for bit (live or snapshot) takes its changed
             elements from the tracker's bitmap, set where the optimizer's main-to-model copy
             changed them: no mirror
    mirror   of every other served tensor (FP8 buffers and scales, untracked parameters), as of
             the last published version: a host copy (pinned when the tensors are on a GPU: no
             second copy of the weights in GPU memory), or on the device
    publish  inside the rank's seqlock: per tensor, the changed elements (the tracker's, or where
             its bits differ from the mirror: compared on the tensor's device, the mirror
             streamed in chunks), packed as int32 indices, 16-bit page offsets or a bitmap,
             whichever is smaller (delta_records.best_format), plus the new values, into slot
             ``n % keep``; the mirror updated at those elements or the tracker's bits cleared; a
             record published under ``delta/<rank>/<epoch>/<version>``, the record of the version
             that used the slot before deleted first

A version whose segments do not fit the slot publishes no record (receivers then pull it in
full, as they do when they missed more than ``keep`` versions). Elements compare as bits, so
``-0.0`` vs ``0.0`` and NaN payloads count as changes and every received byte equals the
trainer's.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.online.delta.records import (
    INDICES,
    PAGE,
    PAGED,
    DeltaRecord,
    DeltaSegment,
    best_format,
    delta_key,
    epoch_key,
    segment_bytes,
)
from megarefit.online.delta.track import ChangeTracker
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.nixl_agent import NixlAgent, mem_type

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits, by itemsize
CHUNK = 1 << 25  # elements compared at once against the mirror on a GPU (bounds the temporary)


class RepublishError(MegarefitError):
    """A delta publisher was asked to publish a version it already published, with other
    content (names the rank, the version and how many elements differ)."""


@dataclass(frozen=True)
class DeltaOptions:
    """``keep``: versions whose deltas stay published (a receiver up to ``keep`` versions behind
    catches up by deltas); ``capacity``: each slot's size as a fraction of the served bytes (a
    version whose delta is larger publishes none: receivers pull it in full); ``slots``:
    ``"host"`` (pinned host memory: no GPU memory, receivers read it through the host) or
    ``"device"`` (the served tensors' GPU: ``keep * capacity`` of the served bytes in GPU memory,
    read GPU to GPU); ``mirror``: where the copy of the last version lives, ``"host"`` (pinned;
    each publish streams it to the GPU to compare) or ``"device"`` (one more copy of the served
    tensors in GPU memory; compared at memory speed)."""

    keep: int = 2
    capacity: float = 0.5
    slots: str = "host"
    mirror: str = "host"

    def __post_init__(self) -> None:
        if self.keep < 1 or not 0.0 < self.capacity <= 4.0 or {self.slots, self.mirror} - {"host", "device"}:
            raise MegarefitError(f"{self}: keep must be at least 1, capacity a fraction of the served bytes in (0, 4], "
                                 "slots and mirror 'host' or 'device'")


@dataclass
class DeltaStats:
    """What the last publish found: its version and base, changed elements of all served
    elements, the bytes packed (0 when none was recorded), whether a record was published and
    the seconds it took (comparing, packing, updating the mirror)."""

    version: int
    base: int | None
    changed: int
    elements: int
    packed_bytes: int
    recorded: bool
    seconds: float


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, flat (a view)."""
    return t.detach().reshape(-1).view(BITS[t.element_size()])


def _mirror_copy(t: torch.Tensor, where: str) -> torch.Tensor:
    """A copy of ``t``'s bits: on its device (``where="device"``), else in (pinned) host memory."""
    if where == "device":
        return bits(t).clone()
    out = torch.empty(t.numel(), dtype=BITS[t.element_size()], pin_memory=t.is_cuda)
    out.copy_(bits(t))
    return out


def changed_elements(cur: torch.Tensor, mirror: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64, ascending, on ``cur``'s device) where ``bits(cur)`` differs from
    ``mirror`` (its copy; a host copy of a GPU tensor is compared in chunks of :data:`CHUNK`
    elements)."""
    flat = bits(cur)
    if mirror.device == flat.device:
        return (flat != mirror).nonzero().view(-1)
    parts = []
    for a in range(0, flat.numel(), CHUNK):
        old = mirror[a:a + CHUNK].to(flat.device, non_blocking=True)
        parts.append((flat[a:a + CHUNK] != old).nonzero().view(-1) + a)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)


def pack_bitmap(idx: torch.Tensor, numel: int) -> torch.Tensor:
    """The bitmap of ``idx`` over ``numel`` elements: uint8 ``[ceil(numel / 8)]``, bit ``j`` of
    byte ``b`` set when element ``8 b + j`` is in ``idx``."""
    mask = torch.zeros((numel + 7) // 8 * 8, dtype=torch.uint8, device=idx.device)
    mask[idx] = 1
    shifts = torch.arange(8, dtype=torch.uint8, device=idx.device)
    return (mask.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


class DeltaLog:
    """Packs and publishes one rank's deltas (see the module docstring).

    ``served``: the tensors receivers read, in manifest order (``entry`` ``i`` of a record is
    ``served[i]``; ``names``: their manifest names, for errors); the slots are registered with
    ``agent``."""

    def __init__(self, served: Sequence[torch.Tensor], agent: NixlAgent, rendezvous: Rendezvous, rank: RankCoord,
                 options: DeltaOptions, tracker: ChangeTracker | None = None,
                 sources: Sequence[torch.Tensor | None] | None = None, names: Sequence[str] | None = None):
        self.served = list(served)
        self.names = list(names) if names is not None else [f"entry {i}" for i in range(len(self.served))]
        self.rendezvous, self.rank, self.options = rendezvous, rank, options
        # served[i]'s changes come from the tracker where sources[i] (the live parameter it holds
        # bit for bit) is tracked; the others are compared against a mirror
        self.tracker = tracker
        self.sources = [s if tracker is not None and s is not None and tracker.covers(s) else None
                        for s in (sources or [None] * len(self.served))]
        self.generation = tracker.generation if tracker is not None else 0
        self.mirror: list[torch.Tensor | None] = []  # copied at the first publish
        total = sum(t.numel() * t.element_size() for t in self.served)
        capacity = max(4096, math.ceil(options.capacity * total / 8) * 8)
        pinned = any(t.is_cuda for t in self.served)
        device = self.served[0].device if options.slots == "device" else torch.device("cpu")
        self.slots = [torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pinned and device.type == "cpu")
                      for _ in range(options.keep)]
        agent.register(self.slots)
        self.slot_version: list[int | None] = [None] * options.keep
        self.base: int | None = None  # the version the mirror holds (None: before the first publish, or unsure)
        self.count = 0  # records written
        self.last: DeltaStats | None = None
        self.epoch = secrets.token_hex(8)  # this process's records; a restarted trainer writes a new one
        rendezvous.put(epoch_key(rank), self.epoch)

    @property
    def nbytes(self) -> int:
        """Bytes held: the mirror of the untracked tensors (host or device) and the slots (host or device)."""
        mirror = sum(t.numel() * t.element_size() for t, s in zip(self.served, self.sources) if s is None)
        return mirror + sum(s.numel() for s in self.slots)

    @property
    def tracked(self) -> int:
        """Served tensors whose changes come from the tracker (the rest are compared with the mirror)."""
        return sum(s is not None for s in self.sources)

    def follow(self, served: Sequence[torch.Tensor], sources: Sequence[torch.Tensor | None]) -> None:
        """After a declared move (:mod:`~megarefit.online.trainer.moved`): ``served`` / ``sources``
        as the constructor's, where the tensors are now. What holds no address stays: the mirrors
        (the last version's bits), the slots and published records (the log's own memory; a
        segment names its tensor by manifest index), the base version. A tensor whose changes come
        from the tracker takes them where the tracker indexes its parameter now (call
        :meth:`ChangeTracker.rekey <megarefit.online.delta.track.ChangeTracker.rekey>` first). The
        move must bring the bytes back as they left (a write the tracker did not see: its
        ``invalidate()``); a mirrored tensor is compared by content anyway.

        Raises:
            MegarefitError: another count of served tensors, one with another element count or
                dtype, or a tracked one whose parameter the tracker no longer covers (or covers on
                another device): names the rank, the tensor and the fix; nothing is changed."""
        if len(served) != len(self.served) or len(sources) != len(self.served):
            raise MegarefitError(f"rank {tuple(self.rank)}: a move brought {len(served)} served tensors back, the "
                                 f"delta log holds {len(self.served)}: re-create the Publisher")
        for name, old, new in zip(self.names, self.served, served):
            if new.numel() != old.numel() or new.dtype != old.dtype:
                raise MegarefitError(f"rank {tuple(self.rank)}: {name} came back from a move as {new.dtype} "
                                     f"[{new.numel()}], its delta log holds {old.dtype} [{old.numel()}]: re-create "
                                     "the Publisher")
        for name, was, src in zip(self.names, self.sources, sources):
            if was is None:
                continue  # compared against its mirror: content, no address
            if src is None or not self.tracker.covers(src) or self.tracker.device_of(src) != src.device:
                raise MegarefitError(
                    f"rank {tuple(self.rank)}: {name} took its changes from the tracker, which no longer tracks "
                    f"the parameter where it is now ({'none' if src is None else f'{src.data_ptr():#x} on {src.device}'}"
                    "): the move replaced the tensor the optimizer writes, or it came back on another device. "
                    "Move the optimizer's own parameters (verl: the DDP buffers in place), or track_changes() "
                    "the optimizer that steps them now and re-create the Publisher")
        self.served = list(served)
        self.sources = [s if was is not None else None for was, s in zip(self.sources, sources)]

    def record(self, version: int) -> DeltaStats:
        """Find, pack and publish the delta from the last recorded version into ``version``
        (call inside the rank's seqlock, after the served tensors hold ``version``). The first
        call, one after writes the tracker did not see, or one of an older version makes the
        served tensors the new base: every record published so far is deleted, none is written.
        The same version again records nothing when the served tensors are unchanged.

        Raises:
            RepublishError: the same version again with other content (nothing is changed: the
                mirror and the tracker's marks still describe the content first published)."""
        t0 = time.perf_counter()
        base, self.base = self.base, None  # unsure until this record is done: a publish that fails part-way
        unseen = self.tracker is not None and self.tracker.generation != self.generation  # written around it
        if base is not None and version == base:
            self.base = base  # (what raises leaves every part as it was)
            self._check_unchanged(version, unseen)
            self.last = DeltaStats(version, base, 0, self._elements(), 0, False, time.perf_counter() - t0)
            return self.last
        if unseen:
            base, self.generation = None, self.tracker.generation
        if base is None or version < base:  # the first version (FP8 / snapshot buffers filled just now), or an
            self._restart()  # older one: the next record is of the delta from this base
            self.base = version
            self.last = DeltaStats(version, None, 0, self._elements(), 0, False, time.perf_counter() - t0)
            return self.last
        k = self.count % self.options.keep
        if self.slot_version[k] is not None:  # its bytes are about to be rewritten: no receiver may use them
            self.rendezvous.store.delete_key(self.rendezvous.prefix
                                             + delta_key(self.rank, self.epoch, self.slot_version[k]))
            self.slot_version[k] = None
        segments, changed = self._pack(self.slots[k])
        used = segments[-1].offset + segments[-1].nbytes if segments else 0
        fits = used <= self.slots[k].numel()
        if fits:
            mem, dev = mem_type(self.slots[k])
            rec = DeltaRecord(version, base, self.slots[k].data_ptr(), self.slots[k].numel(), used, mem, dev,
                              tuple(segments))
            self.rendezvous.put(delta_key(self.rank, self.epoch, version), rec.encode())
            self.slot_version[k] = version
            self.count += 1  # (a version that did not fit leaves the slot free for the next)
        self.base = version
        self.last = DeltaStats(version, base, changed, self._elements(), used if fits else 0, fits,
                               time.perf_counter() - t0)
        return self.last

    def _check_unchanged(self, version: int, unseen: bool) -> None:
        """Raise :class:`RepublishError` when a served tensor differs from ``version`` as first
        published, or when writes the tracker did not see (``unseen``) make that unknowable."""
        if unseen:
            raise RepublishError(
                f"rank {tuple(self.rank)}: version {version} was already published, and the tracker was "
                "invalidated since (writes it did not see), so whether the weights are still those of "
                f"v{version} is unknown. Publish them as a new version (v{version + 1}); until then the rank "
                "stays marked writing, so no receiver accepts its bytes")
        differ = []
        for i, (t, mirror, src) in enumerate(zip(self.served, self.mirror, self.sources)):
            n = (changed_elements(t, mirror) if src is None else self.tracker.changed(src)).numel()
            if n:
                differ.append((i, n))
        if differ:
            raise RepublishError(
                f"rank {tuple(self.rank)}: version {version} was already published, and {len(differ)} served "
                f"tensor(s) now hold other content ({sum(n for _, n in differ)} elements differ; first: "
                f"{self.names[differ[0][0]]}, {differ[0][1]} elements). A version names one content: receivers "
                f"holding v{version} would keep the first. Publish these weights as a new version (v{version + 1}); "
                "until then the rank stays marked writing, so no receiver accepts its bytes")

    def _restart(self) -> None:
        """The served tensors as they are now are the base: mirror the untracked, clear the tracked,
        delete the records published so far (deltas of a history that no longer leads here)."""
        for k, v in enumerate(self.slot_version):
            if v is not None:
                self.rendezvous.store.delete_key(self.rendezvous.prefix + delta_key(self.rank, self.epoch, v))
                self.slot_version[k] = None
        self.mirror = [_mirror_copy(t, self.options.mirror) if src is None else None
                       for t, src in zip(self.served, self.sources)]
        for src in self.sources:
            if src is not None:
                self.tracker.clear(src)

    def _elements(self) -> int:
        return sum(t.numel() for t in self.served)

    def _pack(self, slot: torch.Tensor) -> tuple[list[DeltaSegment], int]:
        """Every served tensor's changed elements packed into ``slot`` (while they fit; the
        segments of all of them are returned, so the caller sees the size needed) and the
        mirror updated; also the count of changed elements."""
        segments: list[DeltaSegment] = []
        at = changed = 0
        for i, (t, mirror, src) in enumerate(zip(self.served, self.mirror, self.sources)):
            idx = changed_elements(t, mirror) if src is None else self.tracker.changed(src)
            n = idx.numel()
            if n == 0:
                continue
            changed += n
            values = bits(t)[idx]
            fmt = best_format(n, t.numel())
            size = segment_bytes(fmt, n, t.numel(), t.element_size())
            if at + size <= slot.numel():
                _write_segment(slot[at:at + size], fmt, idx, values, t.numel())
            segments.append(DeltaSegment(i, fmt, n, at, size))
            at += size
            if src is not None:
                self.tracker.clear(src)
            elif mirror.device == idx.device:
                mirror[idx] = values
            else:
                mirror[idx.cpu()] = values.cpu()
        if slot.is_cuda:  # the slot's bytes must have landed before the record says they are there
            torch.cuda.synchronize(slot.device)
        return segments, changed


def pack_paged(idx: torch.Tensor, numel: int) -> torch.Tensor:
    """``idx`` (ascending) as pages of :data:`~megarefit.online.delta.records.PAGE` elements:
    int32 ``[pages]`` changed counts, then the 16-bit offsets within each page, as uint8."""
    pages = (numel + PAGE - 1) // PAGE
    counts = torch.bincount(idx // PAGE, minlength=pages).to(torch.int32)
    offsets = idx % PAGE
    offsets = (offsets - PAGE * (offsets >= PAGE // 2)).to(torch.int16)  # 0..65535 as 16 bits
    return torch.cat([counts.view(torch.uint8), offsets.view(torch.uint8)])


def _write_segment(out: torch.Tensor, fmt: int, idx: torch.Tensor, values: torch.Tensor, numel: int) -> None:
    """One segment's bytes into ``out`` (uint8): the indices, pages or bitmap, 8-aligned, then the values."""
    if fmt == INDICES:
        mask = idx.to(torch.int32).view(torch.uint8)
    elif fmt == PAGED:
        mask = pack_paged(idx, numel)
    else:
        mask = pack_bitmap(idx, numel)
    out[:mask.numel()].copy_(mask)
    at = (mask.numel() + 7) // 8 * 8
    raw = values.view(torch.uint8)
    out[at:at + raw.numel()].copy_(raw)


__all__ = ["CHUNK", "DeltaLog", "DeltaOptions", "DeltaStats", "RepublishError", "bits", "changed_elements",
           "pack_bitmap", "pack_paged"]
