"""Fan-out: receivers that installed a version serve it to replicas with the same target.

A receiver's arena already holds its targets in their final layout, one contiguous
tensor per dtype. A :class:`RefitReceiver` created with ``replica_group=g`` publishes
that arena (NIXL metadata, arena addresses, the targets' offsets) after every pull; a
:class:`ReplicaReceiver` of group ``g`` mirrors it, so the trainers' links carry the model
once per target group whatever the number of replicas::

    trainers ==READ (plan: thousands of pieces)==> tier 1: RefitReceiver(replica_group=g)
                                                      |  chunk READs (whole arena: served once pulled)
                                  +-------------------+-------------------+
                                  v                                       v
                     ReplicaReceiver (parent = tier 1)        ReplicaReceiver ...
                                  |  chunk c READ as soon as chunk c landed above
                                  v
                     ReplicaReceiver (parent = that replica)   (a chain, or a tree of fan-out k)

**Cut-through** (the default): a serving replica forwards its arena chunk by chunk as chunks
land (``chunk_bytes``, ``inflight`` READs at once; chunks from
:mod:`~megarefit.online.receiver.replica_chunks`). When it starts mirroring a version it takes a
new odd sequence (its *epoch*), announces ``replica_info`` with that epoch, and moves
``replica_progress/<group>/<id>`` ("<epoch> <bytes landed>") after each chunk; its children READ
what the progress covers, while the rest is still on its way. A chain of depth h costs about
(arena + (h - 1) x chunk) / link rate instead of h x arena / link rate::

    time ->     | c0 | c1 | c2 | c3 |                     tier 1 -> r0
                     | c0 | c1 | c2 | c3 |                r0 -> r1
                          | c0 | c1 | c2 | c3 |           r1 -> r2

``cut_through=False`` is store-and-forward: one READ per dtype arena from a whole parent,
served once whole.

**Never a mix of versions.** Each serving arena has a seqlock (``replica_seq/<group>/<id>``):
odd while its owner rewrites it. A replica keeps bytes read from its parent at epoch ``s`` only
if the parent's sequence is still ``s`` (or ``s + 1``: it finished that mirror) after the READ
ended, checked after every completion and at the end
(:class:`~megarefit.online.receiver.replica_read.ParentReader`); a parent that moved to another
version or restarted raises ``StaleVersionError(retryable=True)`` and the replica starts again
under a new epoch of its own, so its children drop what they had too. If its parent dies (a READ
fails, or its heartbeat stands still ``lease`` seconds) or gives up its mirror, the replica logs
a line, marks its own mirror abandoned (its children fail over at once) and pulls from the
trainers through its ``fallback`` receiver (a :class:`RefitReceiver` for the same target), or
raises ``TransferError``. :func:`tree_parent` arranges replicas in registration order into a
tree of fan-out ``k``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from megarefit.errors import MegarefitError
from megarefit.online.receiver.arena import arena_key, publish_arena, tree_parent
from megarefit.online.receiver.receiver import RefitReceiver, StaleVersionError
from megarefit.online.receiver.replica_chunks import ABANDONED, MirrorStats, format_progress
from megarefit.online.receiver.replica_read import ParentReader
from megarefit.online.store.rendezvous import Heartbeat, Rendezvous, RendezvousTimeout
from megarefit.transport.nixl_agent import NixlAgent, TransferError

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20


class ReplicaReceiver:
    """Mirrors the arena of receiver ``parent`` in ``group`` (see the module docstring).

    Args:
        rendezvous: the job's rendezvous.
        group: the replica group (replicas of one vLLM target: same tp rank and experts).
        parent: the id (receiver name) of the receiver or replica to read from.
        name: this replica's NIXL agent name and id; with ``serve=True`` it serves its own
            arena to further replicas (a chain or tree).
        timeout: seconds one attempt may take, waiting for the parent included.
        fallback: a receiver for the same target that reads the trainers, used when the
            parent fails; ``None``: raise instead.
        device: where the mirrored arena lives.
        retries: attempts again after the parent moved to another version or restarted.
        heartbeat_s: seconds between this replica's heartbeats (its children's lease).
        chunk_bytes: the largest READ, in bytes (at least one element is read); with
            ``serve=True`` its children may read a chunk as soon as it landed here.
        inflight: READs posted at once.
        cut_through: read a parent that is still mirroring, and serve each chunk as it lands
            (``False``: store-and-forward, one READ per dtype arena, served once whole).
        lease: seconds the parent's heartbeat may stand still while this waits on it before
            the parent counts as failed (``None``: only ``timeout``).

    Raises:
        MegarefitError: ``chunk_bytes`` or ``inflight`` below 1.
    """

    def __init__(self, rendezvous: Rendezvous, *, group: str, parent: str, name: str, timeout: float = 60.0,
                 fallback: RefitReceiver | None = None, device: torch.device | str = "cpu", serve: bool = False,
                 retries: int = 2, heartbeat_s: float = 1.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 inflight: int = 4, cut_through: bool = True, lease: float | None = 10.0):
        if chunk_bytes < 1 or inflight < 1:
            raise MegarefitError(f"replica {name!r}: chunk_bytes (bytes) and inflight (READs) must be >= 1, got "
                                 f"{chunk_bytes} and {inflight}")
        self.rendezvous, self.group, self.parent, self.name = rendezvous, group, parent, name
        self.timeout, self.fallback, self.device, self.serve, self.retries = timeout, fallback, torch.device(device), \
            serve, retries
        self.cut_through = cut_through
        self.nixl = NixlAgent(name, progress_thread=serve, device=self.device)
        self.reader = ParentReader(rendezvous, self.nixl, group=group, parent=parent, device=self.device,
                                   chunk_bytes=chunk_bytes if cut_through else None, inflight=inflight,
                                   cut_through=cut_through, lease=lease)
        self.version: int | None = None
        self.bytes_read = 0  # bytes READ from the parent in the last cycle
        self.fell_back = False
        self.stats = MirrorStats()
        self._epoch: int | None = None  # the odd sequence this arena is being rewritten under
        rendezvous.register_receiver(name)
        self._heartbeat = Heartbeat(rendezvous, name, heartbeat_s)

    @property
    def arenas(self) -> dict[str, torch.Tensor]:
        """This replica's arena, one flat tensor per dtype, in the parent's served order."""
        return self.reader.arenas

    @property
    def targets(self) -> list[tuple[str, str, int, tuple[int, ...]]]:
        """``(name, dtype, element offset, shape)`` per target, in hand-over order."""
        return self.reader.targets

    @property
    def _loaded(self) -> bytes | None:
        return self.reader.loaded

    def _key(self, kind: str) -> str:
        return self.rendezvous.prefix + arena_key(kind, self.group, self.name)

    def _begin(self) -> None:
        """A new odd sequence (epoch) for this arena: children stop trusting what it held."""
        seq = self.rendezvous.store.add(self._key("seq"), 0)
        self._epoch = self.rendezvous.store.add(self._key("seq"), 2 if seq % 2 else 1)

    def _landed(self, nbytes: int) -> None:
        if self.serve and self.cut_through:
            self.rendezvous.put(arena_key("progress", self.group, self.name), format_progress(self._epoch, nbytes))

    def _publish(self, version: int) -> None:
        publish_arena(self.rendezvous, self.group, self.name, self.arenas, self.targets, version,
                      self.nixl.metadata, epoch=self._epoch)

    def _abandon(self) -> None:
        """Tell children this epoch will not complete (they fail over at once)."""
        if self._epoch is not None:
            with contextlib.suppress(Exception):
                self.rendezvous.put(arena_key("progress", self.group, self.name),
                                    format_progress(self._epoch, ABANDONED))

    def _pull_once(self, version: int | None) -> int:
        deadline = time.monotonic() + self.timeout
        if self.serve:
            self._begin()
        epoch, info = self.reader.wait_served(version, deadline)
        self.reader.prepare(info)
        if self.serve and self.cut_through:  # announce the mirror: children may read what lands
            self._landed(0)
            self._publish(int(info["version"]))
        self.bytes_read = self.reader.read(epoch, self._landed, deadline)
        self.reader.check(epoch)
        self.stats.chunks, self.stats.parent_bytes = len(self.reader.chunks), self.bytes_read
        self.stats.first_read_progress = self.reader.first_read_progress
        return int(info["version"])

    def _mirror(self, version: int | None) -> None:
        for attempt in range(self.retries + 1):
            try:
                self.version = self._pull_once(version)
                return
            except StaleVersionError as exc:
                self.stats.retries += 1
                if not exc.retryable or attempt == self.retries:
                    raise

    def run_refit_cycle(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Mirror the parent's version (``version`` or later; ``None``: what it serves or mirrors
        now) and yield ``(name, tensor)`` views of this replica's arena (valid until the next
        cycle; never write them: descendants read this arena), in the parent's hand-over order.

        Raises:
            TransferError / RendezvousTimeout: the parent failed and there is no fallback.
            StaleVersionError: the parent kept rewriting its arena past ``retries``.
        """
        self.fell_back, self.stats = False, MirrorStats()
        try:
            self._mirror(version)
        except (TransferError, RendezvousTimeout) as exc:
            self._abandon()
            if self.fallback is None:
                raise
            log.warning("replica %s: parent %r failed (%s); pulling from the trainers instead", self.name,
                        self.parent, exc)
            self.fell_back = True
            yield from self.fallback.run_refit_cycle(version)
            return
        except StaleVersionError:
            self._abandon()
            raise
        if self.serve:  # whole, holding the new version (a failed pull leaves it odd: not served)
            if not self.cut_through:
                self._publish(self.version)
            self.rendezvous.store.add(self._key("seq"), 1)
            self._epoch = None
        for name, dtype, offset, shape in self.targets:
            numel = 1
            for n in shape:
                numel *= n
            yield name, self.arenas[dtype][offset: offset + numel].view(shape)

    def acknowledge(self) -> None:
        if self.version is not None:
            self.rendezvous.acknowledge(self.name, self.version)

    def close(self) -> None:
        self._heartbeat.stop()


__all__ = ["DEFAULT_CHUNK_BYTES", "ReplicaReceiver", "publish_arena", "tree_parent"]
