"""One fence record per data-parallel copy: what a warm receiver reads instead of every rank's
generation, update sequence and version (:class:`CopyFences`; :class:`~megarefit.online.store.
rendezvous.Rendezvous` delegates to it).

Keys, under the job prefix (``<c>``: the copy index, ``0`` for the first)::

    writes/<c>     signed; rewritten in the same store write as every change of a rank of copy c
                   (a manifest published, an update begun, a version published), so its record
                   counter ``n`` changes with each of them
    ended/<c>/<v>  a plain counter: how many ranks of copy c published version v
    complete/<c>/<v> signed, written with fence/<c>: a receiver waiting for version v blocks on
                   it at the store, instead of polling every rank's version
    fence/<c>      signed JSON ``{"version": v, "writes": n, "ranks": {"tp.pp.ep[.c]": [generation,
                   sequence]}}``, written by the rank whose end of version v brought the counter to
                   the copy's size, from one snapshot of the store in which every rank of the copy
                   publishes v with an even sequence and writes/<c> has counter n

While writes/<c> still has counter ``n``, no rank of copy c wrote since that snapshot: every one
serves version v, none is writing, none re-registered. So a warm fence start reads two records
per copy its plan reads (writes/<c>, fence/<c>), and its end one (writes/<c>), however many
ranks the copy has; where a counter moved or a record is missing, the fence reads every rank as
before (:mod:`megarefit.online.receiver.fence`). The ended/ counter is plain: forging it can only
make a rank build the record, which it builds from signed records alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from megarefit.layout import RankCoord
from megarefit.online.store.kv import StoreError
from megarefit.online.store.records import RecordAuthenticationError

WAIT_SLICE = 1.0  # seconds a blocking wait for a version lasts before the copies' records are read again


def rank_key(rank: RankCoord) -> str:
    """``tp.pp.ep``, and ``.copy`` for a data-parallel copy past the first."""
    return f"{rank.tp}.{rank.pp}.{rank.ep}" + (f".{rank.copy}" if rank.copy else "")


def writes_key(copy: int) -> str:
    """The key of copy ``copy``'s write marker (relative to the job prefix)."""
    return f"writes/{int(copy)}"


class SignedRecords(Protocol):
    """What the copy fences read and write through: the rendezvous's store, prefix and records."""

    store: Any
    prefix: str

    def put(self, key: str, payload: bytes | str) -> None: ...

    def put_many(self, items: dict[str, bytes | str]) -> None: ...

    def fetch(self, key: str) -> bytes: ...

    def fetch_counted(self, keys: list[str], shared: frozenset[str] = frozenset()) -> list[tuple[int, bytes]]: ...

    def all_present(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class CopyState:
    """What a fence start needs of some ranks, read from their copies' fence records: the
    version they all serve, each rank's update sequence (even) and registration generation,
    and each copy's write counter (``writes``: unchanged at the fence end means no rank of
    the copy wrote)."""

    version: int
    seq: dict[RankCoord, int]
    generations: dict[RankCoord, bytes]
    writes: dict[int, int]


class CopyFences:
    """The fence records of one rendezvous ``records`` (see the module docstring)."""

    def __init__(self, records: SignedRecords):
        self.records = records
        self._seq: dict[RankCoord, int] = {}  # this process's ranks: their update sequences
        self._copy: dict[RankCoord, list[RankCoord]] = {}  # this process's ranks: every rank of their copy

    def registered(self, rank: RankCoord, layout_ranks: Iterable[RankCoord]) -> None:
        """``rank`` published its manifest; ``layout_ranks``: its layout's coordinates, whose
        copies with its copy index are every rank of its copy (:meth:`completed` waits for all)."""
        self._copy[rank] = [RankCoord(r.tp, r.pp, r.ep, rank.copy) for r in layout_ranks]

    def _next_seq(self, rank: RankCoord) -> int:
        """The rank's update sequence plus one (only the rank's own publisher writes it; read
        from the store once per process, as a restarted rank continues its sequence)."""
        if rank not in self._seq:
            key = "seq/" + rank_key(rank)
            present = self.records.store.check([self.records.prefix + key])
            self._seq[rank] = int(self.records.fetch(key)) if present else 0
        self._seq[rank] += 1
        return self._seq[rank]

    def begin_update(self, rank: RankCoord) -> int:
        """Mark ``rank`` writing (its sequence becomes odd) before the first byte changes, with
        its copy's write marker in the same store write; the new sequence."""
        seq = self._next_seq(rank)
        self.records.put_many({"seq/" + rank_key(rank): str(seq), writes_key(rank.copy): rank_key(rank)})
        return seq

    def end_update(self, rank: RankCoord, version: int, copy_ranks: Iterable[RankCoord] | None = None) -> int:
        """Publish ``version`` for ``rank`` and mark it stable (its sequence becomes even), with
        its copy's write marker, in one store write; then :meth:`completed` over ``copy_ranks``
        (every rank of its copy; default: as :meth:`registered` recorded; none: no fence
        record is kept, receivers read each rank). The new sequence."""
        seq, key = self._next_seq(rank), rank_key(rank)
        self.records.put_many({"version/" + key: str(int(version)), "seq/" + key: str(seq),
                               writes_key(rank.copy): key})
        self.completed(rank, version, self._copy.get(rank, ()) if copy_ranks is None else copy_ranks)
        return seq

    def publish_version(self, rank: RankCoord, version: int, copy_ranks: Iterable[RankCoord] | None = None) -> None:
        """Publish ``version`` for ``rank`` whose bytes did not change (no sequence moves), with
        its copy's write marker; ``copy_ranks``: as :meth:`end_update`."""
        self.records.put_many({"version/" + rank_key(rank): str(int(version)), writes_key(rank.copy): rank_key(rank)})
        self.completed(rank, version, self._copy.get(rank, ()) if copy_ranks is None else copy_ranks)

    def completed(self, rank: RankCoord, version: int, ranks: Iterable[RankCoord]) -> bool:
        """Rank ``rank`` published ``version``; ``ranks``: every rank of its copy (its layout's
        coordinates with its copy index). Where that makes every rank of the copy done with
        ``version``, write the copy's fence record from one snapshot; whether it was written
        (not where a rank already moved on, or wrote meanwhile: receivers read every rank)."""
        ranks = sorted({RankCoord(r.tp, r.pp, r.ep, rank.copy) for r in ranks})
        store, prefix = self.records.store, self.records.prefix
        if not ranks or store.add(f"{prefix}ended/{rank.copy}/{int(version)}", 1) < len(ranks):
            return False
        keys = [writes_key(rank.copy)] + [kind + rank_key(r) for kind in ("generation/", "seq/", "version/")
                                          for r in ranks]
        if not store.check([prefix + key for key in keys]):  # a rank of the copy is not registered
            return False
        values = self.records.fetch_counted(keys, _shared(keys))  # one snapshot of the store
        n, rows = values[0][0], [v for _, v in values[1:]]
        k = len(ranks)
        seqs, versions = [int(v) for v in rows[k:2 * k]], [int(v) for v in rows[2 * k:]]
        if any(s % 2 for s in seqs) or set(versions) != {int(version)}:
            return False
        table = {rank_key(r): [g.decode(), s] for r, g, s in zip(ranks, rows[:k], seqs)}
        self.records.put(f"fence/{rank.copy}", json.dumps({"version": int(version), "writes": n, "ranks": table},
                                                          separators=(",", ":")))
        self.records.put(f"complete/{rank.copy}/{int(version)}", "1")  # what a waiting receiver blocks on
        store.delete_key(f"{prefix}ended/{rank.copy}/{int(version)}")
        return True

    def state(self, ranks: Iterable[RankCoord]) -> CopyState | None:
        """The state of ``ranks`` from their copies' fence records, read in one round trip;
        ``None`` where a copy has no record yet, a rank wrote since its copy's record (its write
        counter moved), a rank is not in it, or the copies' records name different versions.

        Raises:
            RecordAuthenticationError: a record not signed with the job secret (or replayed)."""
        ranks = list(ranks)
        copies = sorted({r.copy for r in ranks})
        keys = [key for c in copies for key in (writes_key(c), f"fence/{c}")]
        if not self.records.all_present([self.records.prefix + k for k in keys]):  # once seen: no request
            return None
        values = self.records.fetch_counted(keys, _shared(keys))
        writes, tables, versions = {}, {}, set()
        for i, c in enumerate(copies):
            n, record = values[2 * i][0], _parse(f"fence/{c}", values[2 * i + 1][1])
            if record["writes"] != n:
                return None
            writes[c], tables[c] = n, record["ranks"]
            versions.add(record["version"])
        rows = [tables[r.copy].get(rank_key(r)) for r in ranks]
        if len(versions) != 1 or any(row is None for row in rows):
            return None
        return CopyState(versions.pop(), {r: int(row[1]) for r, row in zip(ranks, rows)},
                         {r: str(row[0]).encode() for r, row in zip(ranks, rows)}, writes)

    def latest(self, copies: Iterable[int]) -> dict[int, int] | None:
        """The version each copy's fence record names (held or not: what was completed last),
        one round trip; ``None`` where a copy has none yet."""
        copies = sorted(set(copies))
        keys = [f"fence/{c}" for c in copies]
        if not self.records.all_present([self.records.prefix + k for k in keys]):
            return None
        values = self.records.fetch_counted(keys, _shared(keys))
        return {c: _parse(k, v)["version"] for c, k, (_, v) in zip(copies, keys, values)}

    def wait_complete(self, copies: Iterable[int], version: int, timeout: float) -> bool:
        """Block until every copy completed ``version`` (its ``complete/<c>/<v>`` key, written
        with the fence record), at most ``timeout`` seconds, the store waiting (the embedded
        store answers when the key is set; Redis polls at 1 to 50 ms). Returns early, ``False``,
        where a copy's record names a newer version (it will never complete this one)."""
        copies = sorted(set(copies))
        keys = [f"{self.records.prefix}complete/{c}/{int(version)}" for c in copies]
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.records.store.wait(keys, max(0.0, min(WAIT_SLICE, deadline - time.monotonic())))
                return True
            except StoreError:
                latest = self.latest(copies)
                if time.monotonic() >= deadline or (latest is not None and max(latest.values()) > version):
                    return False

    def writes(self, copies: Iterable[int]) -> dict[int, int]:
        """Each copy's write counter now (one round trip)."""
        copies = sorted(set(copies))
        keys = [writes_key(c) for c in copies]
        values = self.records.fetch_counted(keys, _shared(keys))
        return {c: n for c, (n, _) in zip(copies, values)}


def _shared(keys: list[str]) -> frozenset[str]:
    """The keys among ``keys`` that every rank of a copy writes (its marker, its fence record):
    their last write may carry a smaller counter than one read before, so no replay check."""
    return frozenset(k for k in keys if k.startswith(("writes/", "fence/")))


def _parse(key: str, payload: bytes) -> dict[str, Any]:
    """A fence record's JSON (signed by a job member: well-formed unless a member is broken).

    Raises:
        RecordAuthenticationError: not the record's form (then nothing acts on it)."""
    try:
        record = json.loads(payload)
        if not (isinstance(record, dict) and isinstance(record.get("version"), int)
                and isinstance(record.get("writes"), int) and isinstance(record.get("ranks"), dict)):
            raise TypeError("fields")
    except (TypeError, ValueError):
        raise RecordAuthenticationError(f"record {key!r} is signed but not a fence record: written by another "
                                        "megarefit version; nothing was done with it") from None
    return record


__all__ = ["CopyFences", "CopyState", "rank_key", "writes_key"]
