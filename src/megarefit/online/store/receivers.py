"""Receiver registration on the rendezvous: append-only registries, heartbeats (leases) and
acknowledgements (:class:`ReceiverRegistry`; :class:`~megarefit.online.store.rendezvous.Rendezvous`
delegates to it).

Keys, under the job prefix: ``<registry>/n`` and ``<registry>/<i>`` (members, signed),
``beat/<id>`` (a plain counter), ``acked/<id>`` (signed: the last version installed).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from megarefit.online.store.records import RendezvousTimeout


class RecordStore(Protocol):
    """What the registry reads and writes through: the rendezvous's store, job prefix and
    signed records (relative keys)."""

    store: Any
    prefix: str

    def put(self, key: str, payload: bytes | str) -> None: ...

    def fetch(self, key: str) -> bytes: ...


class ReceiverRegistry:
    """Registries, heartbeats and acknowledgements of the receivers of one rendezvous ``records``."""

    def __init__(self, records: RecordStore):
        self.records = records

    def _key(self, key: str) -> str:
        return self.records.prefix + key

    def register_receiver(self, rid: str) -> None:
        """Add receiver ``rid`` to the registry (again after a restart: listed once) and beat."""
        self.join("receivers", rid)
        self.heartbeat(rid)

    def heartbeat(self, rid: str) -> None:
        """Move ``rid``'s heartbeat counter (its lease)."""
        self.records.store.add(self._key(f"beat/{rid}"), 1)

    def beat_count(self, rid: str) -> int:
        """``rid``'s heartbeat counter (0 before its first beat)."""
        return self.records.store.add(self._key(f"beat/{rid}"), 0)

    def acknowledge(self, rid: str, version: int) -> None:
        """Receiver ``rid`` installed ``version`` (and no longer reads older bytes)."""
        self.records.put(f"acked/{rid}", str(int(version)))

    def join(self, registry: str, member: str) -> list[str]:
        """Add ``member`` to the append-only list ``registry`` (once, however often it joins:
        a restarted process keeps its place); the members in joining order."""
        members = self.members(registry)
        if member not in members:
            i = self.records.store.add(self._key(f"{registry}/n"), 1)
            self.records.put(f"{registry}/{i}", member)
            members = self.members(registry)
        return members

    def members(self, registry: str) -> list[str]:
        """The members of ``registry`` in joining order (see :meth:`join`)."""
        store = self.records.store
        n = store.add(self._key(f"{registry}/n"), 0)
        out: list[str] = []
        for i in range(1, n + 1):
            if not store.check([self._key(f"{registry}/{i}")]):  # a slot taken, not yet written
                continue
            member = self.records.fetch(f"{registry}/{i}").decode()
            if member not in out:
                out.append(member)
        return out

    def acked(self, rid: str) -> int | None:
        """The last version ``rid`` acknowledged (None before its first)."""
        key = f"acked/{rid}"
        return int(self.records.fetch(key)) if self.records.store.check([self._key(key)]) else None

    def wait_receivers(self, version: int, *, timeout: float = 300.0, lease: float = 10.0) -> dict[str, str]:
        """Block until every live registered receiver acknowledged ``version`` (or later).

        A receiver whose heartbeat counter does not move for ``lease`` seconds (this
        process's clock: no clock skew between hosts matters) is dropped as dead. Returns
        ``{receiver id: "acked" | "dropped"}``.

        Raises:
            RendezvousTimeout: after ``timeout`` seconds, naming each live receiver that has
                not acknowledged and the version it last acknowledged.
        """
        start = time.monotonic()
        seen: dict[str, tuple[int, float]] = {}  # rid -> (beat counter, when it last moved)
        while True:
            now = time.monotonic()
            state: dict[str, str] = {}
            pending: list[str] = []
            for rid in self.members("receivers"):
                beat = self.records.store.add(self._key(f"beat/{rid}"), 0)
                if rid not in seen or seen[rid][0] != beat:
                    seen[rid] = (beat, now)
                acked = self.acked(rid)
                if acked is not None and acked >= version:
                    state[rid] = "acked"
                elif now - seen[rid][1] > lease:
                    state[rid] = "dropped"
                else:
                    pending.append(f"{rid} (last acknowledged {acked})")
            if not pending:
                return state
            if now - start > timeout:
                raise RendezvousTimeout(f"receivers did not acknowledge version {version} after {timeout:.1f} s: "
                                        + ", ".join(pending))
            time.sleep(0.01)


__all__ = ["ReceiverRegistry", "RecordStore"]
