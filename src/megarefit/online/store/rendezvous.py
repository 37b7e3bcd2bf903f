"""Rendezvous for manifests and versions over an authenticated key-value store
(:class:`~megarefit.online.store.kv.KeyValueStore`: bound to the address asked for, open only to
holders of the job secret).

Keys, under a job prefix (``megarefit/<job>/``)::

    manifest/<tp>.<pp>.<ep>   Manifest JSON            (set once per registration)
    nixl/<tp>.<pp>.<ep>       NIXL agent metadata      (bytes; NIXL's own metadata exchange)
    generation/<tp>.<pp>.<ep> digest of both, set last (receivers re-read a rank's manifest only
                              when it changes: a warm cycle reads one short key per rank)
    version/<tp>.<pp>.<ep>    weight version, decimal  (bumped after each optimizer step)
    (a data-parallel copy past the first: <tp>.<pp>.<ep>.<copy>)
    seq/<tp>.<pp>.<ep>        update sequence (a seqlock): odd while the rank rewrites its weights,
                              even when they are stable; receivers accept a pull only if every
                              rank's sequence was even before it and unchanged after it
    writes/<copy>, fence/<copy> one fence record per data-parallel copy, valid while no rank of
                              the copy wrote since: a warm fence reads it, not every rank's keys
                              (:mod:`~megarefit.online.store.copy_fence`)
    consumed/<version>        set by a receiver when it no longer reads that version
    receivers/n, receivers/<i> registered receiver ids (a receiver registers once per process)
    beat/<id>                 the receiver's heartbeat counter (its lease: trainers drop a receiver
                              whose counter stopped moving for ``lease`` seconds of their own clock)
    acked/<id>                the last version the receiver installed

One side serves the store (``Rendezvous.serve``), the others connect
(``Rendezvous.connect``); on one machine the embedded default needs nothing
else running.

Every record megarefit acts on (manifest, NIXL metadata, generation, version, update
sequence, copy write markers and fence records, consumed marks, acknowledgements, registry
members, replica arena records) is signed with the job's secret (``secret=``, else
``MEGAREFIT_JOB_SECRET``; HMAC-SHA256 from the standard library) and checked before use: ``mr1:<mac>:<n>:<payload>``, the MAC over the
job, the key, ``n`` and the payload, ``n`` drawn from the job's counter in the store
(``clock``: one atomic add per record, never a wall clock, so a writer restarted on a host
whose clock is behind still writes newer records), so an older record written again under
its key is refused as replayed. A record that is unsigned, signed with another secret or
replayed raises :class:`RecordAuthenticationError` and nothing acts on it. Heartbeat and
registry counters are plain store counters (the store itself admits only holders of the
secret, and authenticates every message: :mod:`~megarefit.online.store.kv`).
docs/security.md says what this protects and what it does not.

Parts: the record codec, the job secret and the errors are
:mod:`~megarefit.online.store.records`; receiver registration, leases and
acknowledgements are :mod:`~megarefit.online.store.receivers` (:class:`Rendezvous`
delegates to both; its names stay importable from here).
"""

from __future__ import annotations

import atexit
import hashlib
import threading
import time
import warnings
import weakref
from collections.abc import Iterable

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.online.store.copy_fence import CopyFences, rank_key, writes_key
from megarefit.online.store.kv import KeyValueStore, StoreTLS
from megarefit.online.store.receivers import ReceiverRegistry
from megarefit.online.store.records import (
    SECRET_ENV,
    RecordAuthenticationError,
    RecordCodec,
    RendezvousTimeout,
    ensure_job_secret,
    resolve_secret,
)
from megarefit.online.store.redis_kv import RedisStore, is_redis_address
from megarefit.transport.manifest import Manifest


class Rendezvous:
    """Manifest and version exchange between trainer ranks and receivers (signed records; see the module docstring)."""

    def __init__(self, store: KeyValueStore | RedisStore, job: str = "default", secret: bytes | str | None = None):
        self.store = store
        self.job = job
        self.prefix = f"megarefit/{job}/"
        self._secret, _ = resolve_secret(secret, serving=False)
        self._codec = RecordCodec(job, self._secret)  # signs and verifies (replays refused per thread)
        self._registry = ReceiverRegistry(self)  # receivers/, beat/, acked/
        self.copies = CopyFences(self)  # seq/, version/, writes/, ended/, fence/ (one fence record per copy)
        self._seen: dict[RankCoord, tuple[bytes, Manifest, bytes]] = {}  # rank -> (generation, manifest, metadata)
        self._present: set[str] = set()  # keys seen to exist (megarefit never deletes them): no check again

    def all_present(self, keys: list[str]) -> bool:
        """Whether every key (full, with the job prefix) exists: one round trip, none once all were seen (kept)."""
        if self._present.issuperset(keys):
            return True
        if self.store.check(keys):
            self._present.update(keys)
            return True
        return False

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, *, job: str = "default",
              timeout: float = 300.0, secret: bytes | str | None = None,
              tls: StoreTLS | None = None) -> Rendezvous:
        """Host the store (``port=0`` picks a free port; see :attr:`port`). Without ``secret``
        and ``$MEGAREFIT_JOB_SECRET`` a random secret is generated (:attr:`secret`), with a
        warning: hand it to every process of the job as you hand out host and port.
        ``tls``: serve over TLS (``StoreTLS(certfile=, keyfile=, cafile=)``; the connecting
        sides pass ``StoreTLS(cafile=)``). ``host`` a ``redis://`` / ``rediss://`` URL: the
        cluster's Redis holds the table (:class:`~megarefit.online.store.redis_kv.RedisStore`),
        nothing is started here, and this side connects like :meth:`connect`.

        Raises:
            MegarefitError: the secret is shorter than 16 bytes.
            StoreError: the address cannot be bound or the TLS files cannot be read."""
        key, generated = resolve_secret(secret, serving=True)
        if generated:
            warnings.warn(f"no job secret given: generated one (Rendezvous.secret). Pass it to every trainer and "
                          f"receiver of job {job!r} (Rendezvous.connect(..., secret=...), or {SECRET_ENV}) the way "
                          "you pass host and port: whoever learns it can publish weights to this job",
                          stacklevel=2)
        if is_redis_address(host):  # a cluster's Redis serves it: this side only connects
            return cls(RedisStore(host, timeout, tls=tls), job, key)
        return cls(KeyValueStore.serve(host, port, key, timeout, tls=tls), job, key)

    @classmethod
    def connect(cls, host: str, port: int, *, job: str = "default", timeout: float = 300.0,
                secret: bytes | str | None = None, tls: StoreTLS | None = None) -> Rendezvous:
        """Join a served store with the job's secret (``secret=``, else ``$MEGAREFIT_JOB_SECRET``;
        ``str`` or ``bytes``, at least 16 bytes). ``tls``: the store serves TLS
        (``StoreTLS(cafile=...)``). ``host`` a ``redis://`` or ``rediss://`` URL (``port``
        ignored): the table is on that Redis
        (:class:`~megarefit.online.store.redis_kv.RedisStore`), records still signed and
        verified with the job secret.

        Raises:
            MegarefitError: no secret given, or one shorter than 16 bytes (names the fix).
            StoreError: the store cannot be reached, refused the secret, or is not a megarefit
                rendezvous of this job."""
        key, _ = resolve_secret(secret, serving=False)
        if is_redis_address(host):
            return cls(RedisStore(host, timeout, tls=tls), job, key)
        return cls(KeyValueStore(host, port, key, timeout, tls=tls), job, key)

    def channel(self, name: str) -> Rendezvous:
        """A rendezvous of this job's store and secret for other tensors (``"lora/policy"``: a LoRA adapter): its
        manifests, versions, sequences and acknowledgements apart, signed for job ``<job>/<name>``."""
        return Rendezvous(self.store, f"{self.job}/{name}", self._secret)

    @property
    def secret(self) -> str:
        """The job secret (text), to hand to the job's other processes."""
        return self._secret.decode("utf-8", "surrogateescape")

    # ---- signed records ------------------------------------------------------
    def seal(self, key: str, payload: bytes | str) -> bytes:
        """The signed record of ``payload`` under full key ``key`` (``prefix + ...``)."""
        return self._codec.seal(key, self.store.add(self.prefix + "clock", 1), payload)

    def unseal(self, key: str, record: bytes) -> bytes:
        """The payload of a signed record read under full key ``key``.

        Raises:
            RecordAuthenticationError: unsigned, malformed, signed with another secret, or older
                than a record already read under this key."""
        return self._codec.unseal(key, record)

    def put(self, key: str, payload: bytes | str) -> None:
        """Write a signed record under ``key`` (relative to the job prefix)."""
        self.store.set(self.prefix + key, self.seal(self.prefix + key, payload))

    def put_many(self, items: dict[str, bytes | str]) -> None:
        """Write signed records under several keys at once (one counter for all; a reader sees
        all of them or none)."""
        n = self.store.add(self.prefix + "clock", 1)
        self.store.multi_set({self.prefix + k: self._codec.seal(self.prefix + k, n, v) for k, v in items.items()})

    def fetch(self, key: str) -> bytes:
        """Read and verify the record under ``key`` (relative to the job prefix; waits for it
        like ``TCPStore.get``). Raises RecordAuthenticationError as :meth:`unseal`."""
        return self.unseal(self.prefix + key, self.store.get(self.prefix + key))

    def fetch_many(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """:meth:`fetch` of several keys in one round trip (every key must exist; ``timeout``:
        seconds to wait for them, default the store's; ``StoreError`` when they do not appear)."""
        full = [self.prefix + k for k in keys]
        return [self.unseal(k, r) for k, r in zip(full, self.store.multi_get(full, timeout))]

    def fetch_counted(self, keys: list[str], shared: frozenset[str] = frozenset()) -> list[tuple[int, bytes]]:
        """:meth:`fetch_many`, each record as ``(its counter, payload)``; ``shared``: keys several
        processes write (no replay check: ``RecordCodec.unseal_counted(ordered=False)``)."""
        full = [self.prefix + k for k in keys]
        return [self._codec.unseal_counted(f, r, ordered=k not in shared)
                for k, f, r in zip(keys, full, self.store.multi_get(full))]

    @property
    def port(self) -> int:
        return self.store.port

    # ---- trainer side ----------------------------------------------------
    def publish_manifest(self, manifest: Manifest, nixl_metadata: bytes = b"") -> None:
        key = rank_key(manifest.rank)
        text = manifest.to_json()
        self.put("nixl/" + key, nixl_metadata)
        self.put("manifest/" + key, text)
        digest = hashlib.sha256(text.encode() + b"\0" + bytes(nixl_metadata)).hexdigest()[:16]
        if not self.store.check([self.prefix + "seq/" + key]):  # stable from the start: a receiver's fence
            self.put("seq/" + key, "0")  # then reads generations, sequences and versions in one round trip
        self.copies.registered(manifest.rank, manifest.layout.ranks())
        self.put_many({"generation/" + key: f"{self.store.add(self.prefix + 'clock', 1)}-{digest}",
                       writes_key(manifest.rank.copy): key})  # the copy's fence record no longer holds

    def publish_version(self, rank: RankCoord, version: int, copy_ranks: Iterable[RankCoord] | None = None) -> None:
        """Publish ``version`` for ``rank``, its bytes unchanged (``copy_ranks``: see :meth:`end_update`)."""
        self.copies.publish_version(rank, version, copy_ranks)

    def begin_update(self, rank: RankCoord) -> int:
        """Mark ``rank`` writing (its sequence turns odd) before its first byte changes; the sequence."""
        return self.copies.begin_update(rank)

    def end_update(self, rank: RankCoord, version: int, copy_ranks: Iterable[RankCoord] | None = None) -> int:
        """Publish ``version`` for ``rank`` and mark it stable (its sequence turns even); the
        sequence. ``copy_ranks``: every rank of its copy, to keep the copy's fence record (default
        the published manifest's; :meth:`CopyFences.end_update
        <megarefit.online.store.copy_fence.CopyFences.end_update>`)."""
        return self.copies.end_update(rank, version, copy_ranks)

    def cached_manifests(self, ranks: Iterable[RankCoord], generations: dict[RankCoord, bytes]
                         ) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes]] | None:
        """The manifests and metadata this object read before for ``ranks``, where each was read
        at the given generation; ``None`` where one was not (read them again)."""
        seen = [self._seen.get(r) for r in ranks]
        if any(c is None or c[0] != generations.get(r) for r, c in zip(ranks, seen)):
            return None
        return {r: c[1] for r, c in zip(ranks, seen)}, {r: c[2] for r, c in zip(ranks, seen)}

    # ---- receiver side ---------------------------------------------------
    def _wait(self, keys: list[str], timeout: float, what: str) -> None:
        if self.all_present([self.prefix + k for k in keys]):  # all there: at most one round trip
            return
        deadline = time.monotonic() + timeout
        while True:
            missing = [k for k in keys if not self.store.check([self.prefix + k])]
            if not missing:
                return
            if time.monotonic() > deadline:
                ranks = [k.rsplit("/", 1)[1] for k in missing[:8]]
                by = "receivers" if what.startswith("receiver") else "trainers"  # consumed/<version>: not a rank
                source = "" if by == "receivers" else f" from trainer ranks {ranks} (tp.pp.ep[.copy])"
                raise RendezvousTimeout(
                    f"no {what} after {timeout:.1f} s{source} of job {self.job!r} at the "
                    f"rendezvous {self.store.host}:{self.store.port} (keys {missing[:8]}): check that the {by} "
                    "were started with this job name and rendezvous, and are alive")
            time.sleep(0.01)

    def manifests(self, ranks: Iterable[RankCoord] | None = None, *,
                  timeout: float = 60.0) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes]]:
        """Wait for and read every rank's manifest and NIXL metadata (re-read and parsed only
        when the rank's generation key changed since this object last read it).

        Without ``ranks``, rank (0, 0, 0)'s manifest tells the layout and hence the ranks.

        Raises:
            RendezvousTimeout: naming the ranks that did not publish.
        """
        manifests, metadata, _ = self.manifests_and_state(ranks, timeout=timeout)
        return manifests, metadata

    def manifests_and_state(self, ranks: Iterable[RankCoord] | None = None, *, timeout: float = 60.0
                            ) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes],
                                       tuple[dict[RankCoord, int], dict[RankCoord, int | None]] | None]:
        """:meth:`manifests`, and the ranks' :meth:`state` read in the same round trip as their
        generations (``None`` where some rank has no sequence or version yet): a warm receiver's
        fence start is one store read."""
        if ranks is None:
            self._wait(["generation/0.0.0"], timeout, "manifest")
            first = Manifest.from_json(self.fetch("manifest/0.0.0"))
            ranks = first.layout.ranks()
        ranks = list(ranks)
        self._wait([f"generation/{rank_key(r)}" for r in ranks], timeout, "manifest")  # names the missing ranks
        manifests, metadata = {}, {}
        keys = ["generation/" + rank_key(r) for r in ranks]
        both = [kind + rank_key(r) for kind in ("seq/", "version/") for r in ranks]
        with_state = self.all_present([self.prefix + k for k in both])
        values = self.fetch_many(keys + both if with_state else keys)
        generations = values[:len(ranks)]
        state = None
        if with_state:
            numbers = [int(v) for v in values[len(ranks):]]
            state = dict(zip(ranks, numbers[:len(ranks)])), dict(zip(ranks, numbers[len(ranks):]))
        for r, gen in zip(ranks, generations):
            key = rank_key(r)
            cached = self._seen.get(r)
            if cached is None or cached[0] != gen:  # new or re-registered: read and parse once
                cached = (gen, Manifest.from_json(self.fetch("manifest/" + key)), self.fetch("nixl/" + key))
                self._seen[r] = cached
            manifests[r], metadata[r] = cached[1], cached[2]
        return manifests, metadata, state

    def generations(self, ranks: Iterable[RankCoord]) -> dict[RankCoord, bytes | None]:
        """Each rank's registration generation (``None``: never registered); it changes when the
        rank publishes a new manifest (a restarted trainer)."""
        ranks = list(ranks)
        keys = [self.prefix + "generation/" + rank_key(r) for r in ranks]
        return {r: self.store.get(k) if self.store.check([k]) else None for r, k in zip(ranks, keys)}

    def versions(self, ranks: Iterable[RankCoord]) -> dict[RankCoord, int | None]:
        """Current version per rank (``None`` where none was published yet); one round trip
        when every rank published one."""
        ranks = list(ranks)
        keys = ["version/" + rank_key(r) for r in ranks]
        if self.all_present([self.prefix + k for k in keys]):
            return {r: int(v) for r, v in zip(ranks, self.fetch_many(keys))}
        return {r: int(self.fetch(k)) if self.store.check([self.prefix + k]) else None for r, k in zip(ranks, keys)}

    def sequences(self, ranks: Iterable[RankCoord]) -> dict[RankCoord, int]:
        """Current update sequence per rank (0 where the rank never began an update; odd:
        writing now); one round trip when every rank has begun an update before."""
        ranks = list(ranks)
        keys = ["seq/" + rank_key(r) for r in ranks]
        if self.all_present([self.prefix + k for k in keys]):
            return {r: int(v) for r, v in zip(ranks, self.fetch_many(keys))}
        return {r: int(self.fetch(k)) if self.store.check([self.prefix + k]) else 0 for r, k in zip(ranks, keys)}

    def state(self, ranks: Iterable[RankCoord]) -> tuple[dict[RankCoord, int], dict[RankCoord, int | None]]:
        """(update sequences, versions) of ``ranks`` read together: one round trip (a snapshot of
        the store) once every key exists, else as :meth:`sequences` then :meth:`versions`."""
        ranks = list(ranks)
        keys = [kind + rank_key(r) for kind in ("seq/", "version/") for r in ranks]
        if not self.all_present([self.prefix + k for k in keys]):
            return self.sequences(ranks), self.versions(ranks)
        values = [int(v) for v in self.fetch_many(keys)]
        return dict(zip(ranks, values[:len(ranks)])), dict(zip(ranks, values[len(ranks):]))

    # ---- hand-shake (optional): trainers may wait until a version was read ----
    def mark_consumed(self, version: int) -> None:
        self.put(f"consumed/{int(version)}", "1")

    def wait_consumed(self, version: int, timeout: float = 300.0) -> None:
        """Block until a receiver marked ``version`` consumed (raises RendezvousTimeout, or
        RecordAuthenticationError for a mark not signed with the job secret)."""
        self._wait([f"consumed/{int(version)}"], timeout, f"receiver consumed version {version}")
        self.fetch(f"consumed/{int(version)}")

    # ---- receivers: registration, leases, acknowledgements (rendezvous_receivers.py) ----
    def register_receiver(self, rid: str) -> None:
        """Add receiver ``rid`` to the registry (again after a restart: listed once) and beat."""
        self._registry.register_receiver(rid)

    def heartbeat(self, rid: str) -> None:
        self._registry.heartbeat(rid)

    def acknowledge(self, rid: str, version: int) -> None:
        """Receiver ``rid`` installed ``version`` (and no longer reads older bytes)."""
        self._registry.acknowledge(rid, version)

    def receivers(self) -> list[str]:
        """Registered receiver ids, in registration order."""
        return self._registry.members("receivers")

    def join(self, registry: str, member: str) -> list[str]:
        """Add ``member`` to append-only ``registry`` (once: a restarted process keeps its place); the members."""
        return self._registry.join(registry, member)

    def members(self, registry: str) -> list[str]:
        """The members of ``registry`` in joining order (see :meth:`join`)."""
        return self._registry.members(registry)

    def acked(self, rid: str) -> int | None:
        return self._registry.acked(rid)

    def wait_receivers(self, version: int, *, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """Block until every live registered receiver acknowledged ``version`` (or later);
        ``{receiver id: "acked" | "dropped"}`` (dead after ``lease`` seconds without a heartbeat;
        ``RendezvousTimeout`` after ``timeout``): :meth:`ReceiverRegistry.wait_receivers
        <megarefit.online.store.receivers.ReceiverRegistry.wait_receivers>`."""
        return self._registry.wait_receivers(version, timeout=timeout, lease=lease)


_LIVE: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


@atexit.register
def _stop_heartbeats() -> None:  # before the stores go away: no failed beats at interpreter exit
    for beat in list(_LIVE):
        beat.stop()


class Heartbeat:
    """Beats for receiver ``rid`` every ``interval`` seconds on a daemon thread (its own store
    connection), until :meth:`stop` (or interpreter exit)."""

    def __init__(self, rendezvous: Rendezvous, rid: str, interval: float = 1.0):
        store = rendezvous.store
        self._rdzv = Rendezvous(store.reopen(30.0), rendezvous.job, rendezvous._secret)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(rid, interval), daemon=True,
                                        name=f"megarefit-heartbeat-{rid}")
        self._thread.start()
        _LIVE.add(self)

    def _run(self, rid: str, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._rdzv.heartbeat(rid)
            except (MegarefitError, RuntimeError, OSError):  # the store went away: the trainers will drop this receiver
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._rdzv.store.close()


__all__ = ["SECRET_ENV", "Heartbeat", "RecordAuthenticationError", "Rendezvous", "RendezvousTimeout",
           "ensure_job_secret"]
