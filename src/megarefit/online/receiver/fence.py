"""The version fence: which ranks serve, which version, and whether a pull read it whole.

A pull is bracketed by two reads of every trainer rank's update sequence and version (a
seqlock; ``Publisher.updating`` makes a rank's sequence odd while it writes)::

    start   discover the ranks' manifests, wait until no sequence is odd, wait for the version
    ...     the bytes are read (the pipeline)
    end     read the sequences and versions again: a rank that moved past the version or whose
            sequence changed wrote during the pull -> StaleVersionError (``retryable`` where a
            new pull can succeed); streamed, after tensors were handed over -> TornUpdateError

A warm start reads, instead of every rank's keys, one fence record per data-parallel copy its
plan reads, and the end that copy's write counter (:mod:`megarefit.online.store.copy_fence`),
while those hold; else every rank's, as above.

A streamed cycle that fails over (:mod:`~megarefit.online.receiver.streamed`) checks the failed
rank then (still as at the start) and adds its replacements, their sequences read before their
bytes (:meth:`VersionFence.failed_over`): the end fence covers every byte handed over.

The fence reads only the rendezvous: it moves no bytes and holds no memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from megarefit.layout import RankCoord
from megarefit.online.receiver.cycle import StaleVersionError, TornUpdateError, VersionMismatchError
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.manifest import Manifest


@dataclass(frozen=True)
class FenceStart:
    """What the fence read before the bytes: every rank's manifest and NIXL metadata, the ranks
    in order, their update sequences (all even) and the common version; ``asked``: the version
    the caller asked for (``None``: whatever every rank serves); ``writes``: where it was read
    from the copies' fence records (:mod:`~megarefit.online.store.copy_fence`), each copy's
    write counter, which the end fence reads instead of every rank's sequence."""

    manifests: dict[RankCoord, Manifest]
    metadata: dict[RankCoord, bytes]
    ranks: list[RankCoord]
    seq: dict[RankCoord, int]
    version: int
    asked: int | None
    writes: dict[int, int] | None = None  # read from the copies' fence records: their write counters


def _no_lap(stage: str) -> None:
    """A lap that records nothing."""


class VersionFence:
    """The version fence of receiver ``name`` (see the module docstring); it remembers the
    ranks it discovered last, so a warm cycle reads only their manifests."""

    def __init__(self, rendezvous: Rendezvous, name: str,
                 ranks_for: Callable[[Manifest], list[RankCoord]] | None = None):
        """``ranks_for``: the ranks to fence, given a rank's manifest (its layout): the ranks the
        receiver's plan reads (``PlanCache.ranks_for``); default every coordinate's first copy."""
        self.rendezvous = rendezvous
        self.name = name
        self.ranks_for = ranks_for or (lambda first: first.layout.ranks())
        self.manifests: dict[RankCoord, Manifest] = {}  # the last discovery's
        self.version = 0  # the newest version a start read (fence records naming an older one: replayed)

    def where(self) -> str:
        """This receiver's job and rendezvous, for error messages."""
        store = self.rendezvous.store
        return f"receiver {self.name!r}, job {self.rendezvous.job!r}, rendezvous {store.host}:{store.port}"

    def discover(self, timeout: float) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes], tuple | None]:
        """Every rank's manifest and metadata, and their (sequences, versions) read with them
        (``None`` if not all there yet).

        Raises:
            RendezvousTimeout: a rank published no manifest within ``timeout`` seconds."""
        manifests, metadata, state = self.rendezvous.manifests_and_state(self.manifests.keys() or None,
                                                                         timeout=timeout)
        first = manifests[min(manifests)]
        wanted = self.ranks_for(first)
        if set(manifests) != set(wanted):  # a new layout: discover the ranks it reads
            manifests, metadata, state = self.rendezvous.manifests_and_state(wanted, timeout=timeout)
        self.manifests = manifests
        return manifests, metadata, state

    def wait_stable(self, ranks: list[RankCoord], timeout: float, first: tuple | None = None
                    ) -> tuple[dict[RankCoord, int], dict[RankCoord, int | None]]:
        """Every rank's update sequence once none is odd (no rank inside ``updating``), and the
        versions read with them (``first``: a read already made, used before reading again).

        Raises:
            StaleVersionError: a rank still writing after ``timeout`` seconds (names it)."""
        deadline = time.monotonic() + timeout
        while True:
            seq, versions = first if first is not None else self.rendezvous.state(ranks)
            first = None
            writing = sorted(r for r, n in seq.items() if n % 2)
            if not writing:
                return seq, versions
            if time.monotonic() > deadline:
                raise StaleVersionError(f"trainer ranks still writing their weights after {timeout:.1f} s "
                                        f"(inside Publisher.updating, or an update that raised; {self.where()}): "
                                        + ", ".join(str(tuple(r)) for r in writing))
            time.sleep(0.001)

    def wait_version(self, ranks: list[RankCoord], version: int | None, seen: dict[RankCoord, int | None],
                     timeout: float, since: float | None = None) -> tuple[int, bool]:
        """The common version (``version`` if given; ``seen``: the versions just read) and whether
        it had to be waited for (``since``: when the cycle began waiting, for the error's seconds).

        Raises:
            VersionMismatchError: no common (or not the asked) version after ``timeout`` seconds;
                names each rank's version. At once where a rank already publishes a version
                newer than the asked one: versions only move forward, it will never be common."""
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            values = set(seen.values())
            if version is None and len(values) == 1 and None not in values:
                return values.pop(), waited  # type: ignore[return-value]
            if version is not None and values == {version}:
                return version, waited
            if version is not None and any(v is not None and v > version for v in values):
                raise VersionMismatchError(self._passed(version, seen))
            waited = True
            if time.monotonic() > deadline:
                detail = ", ".join(f"{tuple(r)}: {v}" for r, v in sorted(seen.items()))
                want = f"version {version}" if version is not None else "one common version"
                waited_s = timeout if since is None else time.monotonic() - since
                raise VersionMismatchError(f"trainer ranks do not publish {want} after {waited_s:.1f} s: "
                                           f"{detail} (ranks as (tp, pp, ep): their versions; {self.where()}); "
                                           "publish it from every rank, or ask for the version they serve")
            time.sleep(0.005)
            seen = self.rendezvous.versions(ranks)

    def _passed(self, version: int, seen: dict[RankCoord, int | None]) -> str:
        """Why ``version`` will never be served: the ranks past it, and every rank's version."""
        past = ", ".join(str(tuple(r)) for r, v in sorted(seen.items()) if v is not None and v > version)
        detail = ", ".join(f"{tuple(r)}: {v}" for r, v in sorted(seen.items()))
        return (f"trainer ranks {past} already publish a version newer than the asked version {version}, which "
                f"they will never publish again (versions only move forward): {detail} (ranks as (tp, pp, ep): "
                f"their versions; {self.where()}); ask for the version they serve, or for none (the latest)")

    def _from_records(self, version: int | None) -> FenceStart | None:
        """A warm start read from the fence records of the copies the plan reads: where every
        rank it reads is one this fence discovered before, at the same generation, and serves
        ``version`` (or, with none asked, the version the records name); else ``None``."""
        if not self.manifests:
            return None
        ranks = sorted(self.ranks_for(self.manifests[min(self.manifests)]))
        state = self.rendezvous.copies.state(ranks)
        if state is None or (version is not None and state.version != version):
            return None
        if state.version < self.version:  # an old pair written again, or a trainer restarted from a checkpoint:
            return None  # each rank's own records say which (a replayed one is refused there, by its counter)
        cached = self.rendezvous.cached_manifests(ranks, state.generations)
        if cached is None:
            return None
        return FenceStart(cached[0], cached[1], ranks, state.seq, state.version, version, state.writes)

    def _await_records(self, version: int | None, timeout: float) -> FenceStart | None:
        """A warm start for an asked ``version`` the copies' records do not name yet: wait for
        every copy to complete it, blocking at the store (``CopyFences.wait_complete``), then
        read it from the records; ``None`` where there is nothing to wait on this way (no
        version asked, a cold fence, no record yet, a copy already past it)."""
        if version is None or not self.manifests:
            return None
        copies = {r.copy for r in self.ranks_for(self.manifests[min(self.manifests)])}
        latest = self.rendezvous.copies.latest(copies)
        if latest is None or max(latest.values()) >= version:
            return None
        if not self.rendezvous.copies.wait_complete(copies, version, timeout):
            return None
        return self._from_records(version)

    def start(self, version: int | None, timeout: float, lap: Callable[[str], None] = _no_lap) -> FenceStart:
        """Discover the ranks, read their update sequences once none is writing (the seqlock,
        before the bytes) and wait for the version (``lap``: called after ``"discover"`` and
        ``"version"``).

        Raises:
            RendezvousTimeout / StaleVersionError / VersionMismatchError: see the methods above;
            StaleVersionError (retryable) also when the ranks changed while waiting."""
        began = time.monotonic()
        warm = self._from_records(version) or self._await_records(version, timeout)
        if warm is not None:  # two records per copy instead of three per rank
            lap("discover")
            lap("version")
            self.version = max(self.version, warm.version)
            return warm
        timeout = max(0.05, timeout - (time.monotonic() - began))  # what a wait above left of it
        manifests, metadata, state = self.discover(timeout)
        lap("discover")
        ranks = sorted(manifests)
        seq, seen = self.wait_stable(ranks, timeout, state)  # seqlock: read before the bytes (with the generations)
        got, waited = self.wait_version(ranks, version, seen, timeout, since=began)
        if waited:  # a rank (re)started or re-registered meanwhile: its manifest may be new
            manifests, metadata, _ = self.discover(timeout)
            if sorted(manifests) != ranks:
                raise StaleVersionError("the trainer layout changed while waiting for a version", retryable=True)
            deadline = time.monotonic() + timeout
            while True:  # the sequences as of the version waited for, not of the wait's start
                seq, seen = self.wait_stable(ranks, timeout)
                if set(seen.values()) == {got}:
                    break
                moved = ", ".join(f"{tuple(r)} -> {v}" for r, v in sorted(seen.items()))
                if version is not None or time.monotonic() > deadline:  # (the latest kept moving: try again later)
                    raise StaleVersionError(f"ranks moved past version {got} while it was awaited: {moved}",
                                            retryable=version is None)
                got, _ = self.wait_version(ranks, None, seen, timeout)  # the latest: wait for it to be common again
        lap("version")
        self.version = max(self.version, got)
        return FenceStart(manifests, metadata, ranks, seq, got, version)

    def end(self, start: FenceStart) -> None:
        """Re-read versions and update sequences after the bytes landed.

        Raises:
            StaleVersionError: a rank moved past ``start.version`` (``retryable`` if no version
                was asked for) or wrote during the pull (``retryable``)."""
        if start.writes is not None and self.rendezvous.copies.writes(start.writes) == start.writes:
            return  # no rank of those copies wrote since their fence records: one record per copy
        ranks, seq, got = start.ranks, start.seq, start.version
        seq_after, after = self.rendezvous.state(ranks)  # seqlock: read after the bytes landed
        moved = {r: v for r, v in after.items() if v != got}
        if moved:
            raise StaleVersionError(f"ranks moved past version {got} during the pull: "
                                    + ", ".join(f"{tuple(r)} -> {v}" for r, v in sorted(moved.items())),
                                    retryable=start.asked is None)
        rewritten = sorted(r for r in ranks if seq_after[r] != seq[r])
        if rewritten:
            raise StaleVersionError(f"ranks wrote their weights during the pull of version {got} (update sequence "
                                    "moved): " + ", ".join(f"{tuple(r)} {seq[r]} -> {seq_after[r]}" for r in rewritten),
                                    retryable=True)

    def failed_over(self, start: FenceStart, rank: RankCoord, ranks: list[RankCoord], timeout: float) -> FenceStart:
        """The fence of a streamed cycle once ``rank``'s READ failed and a new plan reads ``ranks``
        instead: ``rank`` left out, its sequence and version still as at ``start`` (nothing it served
        was written while read); the ranks of ``ranks`` not fenced yet added, their manifests read
        and their sequences read now, before their bytes, at ``start.version``. The end fence
        (:meth:`torn`) then checks every rank left.

        Raises:
            RendezvousTimeout: a new rank publishes no manifest within ``timeout`` seconds.
            StaleVersionError: ``rank`` wrote or moved since ``start``, or a new rank is writing or
                serves another version (names them; ``retryable`` where a new cycle can succeed)."""
        added = sorted(r for r in ranks if r not in start.seq and r != rank)
        manifests, metadata = dict(start.manifests), dict(start.metadata)
        if added:
            new, meta, _ = self.rendezvous.manifests_and_state(added, timeout=timeout)
            manifests.update(new)
            metadata.update(meta)
        seq, versions = self.rendezvous.state([rank, *added])
        bad = [f"{tuple(r)}{' (failed)' if r == rank else ''}: sequence {start.seq.get(r, 'even')} -> {seq[r]}, "
               f"version {versions[r]}" for r in [rank, *added]
               if versions[r] != start.version or (seq[r] != start.seq[r] if r == rank else seq[r] % 2)]
        if bad:
            raise StaleVersionError(f"failing over from trainer rank {tuple(rank)} during the streamed pull of version "
                                    f"{start.version} ({self.where()}): " + "; ".join(bad),
                                    retryable=start.asked is None or all(versions[r] == start.version for r in versions))
        keep = [r for r in start.ranks if r != rank] + added
        manifests.pop(rank, None)
        metadata.pop(rank, None)
        self.manifests = manifests
        return FenceStart(manifests, metadata, sorted(keep), {r: start.seq[r] if r in start.seq else seq[r] for r in keep},
                          start.version, start.asked)

    def torn(self, start: FenceStart, handed: int) -> TornUpdateError | None:
        """The end fence of a streamed cycle that handed ``handed`` groups over: the
        :class:`TornUpdateError` to report (its cause: the StaleVersionError :meth:`end`
        raised; as retryable as that), or ``None`` when the cycle read one version whole."""
        try:
            self.end(start)
        except StaleVersionError as exc:
            error = TornUpdateError(f"{exc}; {handed} groups were already handed over, so the consumer "
                                    "holds a mix of versions: it must not serve until a refit cycle completes",
                                    retryable=exc.retryable)
            error.__cause__ = exc
            return error
        return None


__all__ = ["FenceStart", "VersionFence"]
