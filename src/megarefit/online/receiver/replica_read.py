"""A replica's reads of its parent's served arena: chunk by chunk, while the parent still fills it.

The parent is a :class:`~megarefit.online.receiver.receiver.RefitReceiver` with ``replica_group``
(its arena is whole once it serves: sequence even, ``replica_info`` published) or a serving
:class:`~megarefit.online.receiver.replica.ReplicaReceiver` (it announces ``replica_info`` with
an ``epoch`` = its odd sequence when it starts mirroring a version, then moves
``replica_progress`` as chunks land, and makes its sequence even when all did).

What a parent serves at sequence ``s`` (its *epoch*)::

    s even, info without epoch or epoch s - 1   whole: every byte landed
    s odd,  info epoch s                        mirroring: bytes [0, progress) of the served order landed

Bytes read at epoch ``s`` are kept only if the parent's sequence is still ``s`` (or ``s + 1``:
it finished that same mirror) after the READ completed: checked after every completion and at
the end, so a parent that moved to another version or restarted (a new epoch) raises
``StaleVersionError(retryable=True)`` before this replica counts any byte of the other epoch as
landed. Landed bytes are therefore never a mix of two versions, down a chain of any depth.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from megarefit.online.receiver.arena import arena_key
from megarefit.online.receiver.cycle import StaleVersionError
from megarefit.online.receiver.replica_chunks import ABANDONED, Chunk, parse_progress, plan_chunks
from megarefit.online.store.receivers import ReceiverRegistry
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type

__all__ = ["ParentReader"]


class ParentReader:
    """Reads the arena ``parent`` serves in ``group`` into arenas of its own (see the module docstring).

    ``chunk_bytes``: the largest READ in bytes (``None``: one READ per dtype arena);
    ``inflight``: READs posted at once; ``cut_through``: read a parent that is still mirroring
    (else only a whole one); ``lease``: seconds the parent's heartbeat may stand still while this
    waits on it (``None``: no check)."""

    def __init__(self, rendezvous: Rendezvous, nixl: NixlAgent, *, group: str, parent: str, device: torch.device,
                 chunk_bytes: int | None, inflight: int, cut_through: bool, lease: float | None):
        self.rendezvous, self.nixl, self.group, self.parent, self.device = rendezvous, nixl, group, parent, device
        self.chunk_bytes, self.inflight, self.cut_through, self.lease = chunk_bytes, inflight, cut_through, lease
        self.arenas: dict[str, torch.Tensor] = {}  # in the parent's served order
        self.targets: list[tuple[str, str, int, tuple[int, ...]]] = []
        self.chunks: tuple[Chunk, ...] = ()
        self.first_read_progress: int | None = None  # the parent's progress when the first READ was posted
        self.parent_landed = 0  # bytes: the parent's progress last seen
        self.done_bytes = 0  # bytes: the landed, checked prefix of this arena
        self.loaded: bytes | None = None  # the parent's NIXL metadata held by this agent
        self._prepared: tuple[bytes, str] | None = None
        self._handles: list[Any] = []
        self._dlists: list[Any] = []
        self._beats = ReceiverRegistry(rendezvous)

    def _key(self, kind: str) -> str:
        return self.rendezvous.prefix + arena_key(kind, self.group, self.parent)

    def _seq(self) -> int:
        return self.rendezvous.store.add(self._key("seq"), 0)

    def _progress(self) -> tuple[int, int] | None:
        if not self.rendezvous.store.check([self._key("progress")]):
            return None
        return parse_progress(self.rendezvous.fetch(arena_key("progress", self.group, self.parent)))  # (signed)

    def _usable(self, seq: int, info: dict[str, Any]) -> bool:
        epoch = info.get("epoch")
        if seq % 2:
            return self.cut_through and epoch == seq
        return epoch is None or epoch == seq - 1

    def wait_served(self, version: int | None, deadline: float) -> tuple[int, dict[str, Any]]:
        """``(epoch, info)`` once the parent serves or mirrors ``version`` or later (``None``: any).

        Raises:
            RendezvousTimeout: no such arena served before ``deadline`` (the parent is even).
            StaleVersionError: the parent kept rewriting its arena (odd) until ``deadline``.
            TransferError: the parent abandoned its mirror, or its heartbeat stood still ``lease`` s."""
        beat = self._beats.beat_count(self.parent), time.monotonic()
        while True:
            beat = self._alive(beat)
            seq = self._seq()
            if seq % 2 and (p := self._progress()) is not None and p == (seq, ABANDONED):
                raise TransferError(f"replica parent {self.parent!r} gave up mirroring (epoch {seq})")
            if self.rendezvous.store.check([self._key("info")]):
                info = json.loads(self.rendezvous.fetch(arena_key("info", self.group, self.parent)))
                if self._usable(seq, info) and (version is None or int(info["version"]) >= version):
                    return seq, info
            if time.monotonic() > deadline:
                if seq % 2:
                    raise StaleVersionError(f"replica parent {self.parent!r} still writing its arena at the deadline "
                                            f"(sequence {seq})")
                raise RendezvousTimeout(f"replica parent {self.parent!r} of group {self.group!r} serves no arena"
                                        + ("" if version is None else f" of version >= {version}")
                                        + " before the deadline")
            time.sleep(0.001)

    def _alive(self, beat: tuple[int, float]) -> tuple[int, float]:
        now, count = time.monotonic(), self._beats.beat_count(self.parent)
        if count != beat[0]:
            return count, now
        if self.lease is not None and now - beat[1] > self.lease:
            raise TransferError(f"replica parent {self.parent!r} stopped beating: no heartbeat for "
                                f"{now - beat[1]:.1f} s (lease {self.lease:g} s); it died or hangs")
        return beat

    def check(self, epoch: int) -> None:
        """Raise ``StaleVersionError(retryable=True)`` unless the parent still serves ``epoch``
        (or finished that same mirror): bytes read from it so far are of that epoch."""
        seq = self._seq()
        if seq != epoch and not (epoch % 2 and seq == epoch + 1):
            raise StaleVersionError(f"replica parent {self.parent!r} moved from epoch {epoch} to {seq} (another "
                                    f"version, or it restarted) during the pull", retryable=True)

    def landed(self, epoch: int) -> int:
        """Bytes of the served order the parent holds for ``epoch`` (all, once it is whole).

        Raises:
            StaleVersionError: the parent left ``epoch`` (retryable).
            TransferError: the parent abandoned this mirror."""
        total = self.chunks[-1].end if self.chunks else 0
        seq = self._seq()
        if seq == epoch and epoch % 2:
            progress = self._progress()
            if progress is None or progress[0] < epoch:
                return 0
            if progress[0] == epoch:
                if progress[1] == ABANDONED:
                    raise TransferError(f"replica parent {self.parent!r} gave up mirroring (epoch {epoch})")
                return progress[1]
            raise StaleVersionError(f"replica parent {self.parent!r} began epoch {progress[0]} after {epoch} "
                                    f"during the pull", retryable=True)
        self.check(epoch)
        return total

    def prepare(self, info: dict[str, Any]) -> None:
        """Load the parent's metadata, size this replica's arenas as the parent's (registered),
        cut the chunks and prepare one READ per chunk; kept while the parent's memory is.

        Raises:
            TransferError: NIXL could not load the parent's metadata (it died) or prepare the READs."""
        meta = self.rendezvous.fetch(arena_key("meta", self.group, self.parent))
        agent = self.nixl.agent
        if meta != self.loaded:
            try:
                if self.loaded is not None:
                    agent.remove_remote_agent(info["agent"])
                self.loaded, self._prepared = None, None
                agent.add_remote_agent(meta)
            except Exception as exc:  # nixl's own errors: a parent that died cannot be reached
                raise TransferError(f"replica parent {self.parent!r}: loading its NIXL metadata failed: {exc!r}") \
                    from exc
            self.loaded = meta
        shape = json.dumps([info["arenas"], info["targets"]])
        if self._prepared == (meta, shape):
            return
        arenas = {}
        for d, (_, numel, _, _) in info["arenas"].items():
            old = self.arenas.get(d)
            arenas[d] = old if old is not None and old.numel() == numel else \
                torch.empty(numel, dtype=torch_dtype(d), device=self.device)
        self.arenas = arenas
        self.nixl.register(list(arenas.values()))
        self.targets = [(n, d, o, tuple(s)) for n, d, o, s in info["targets"]]
        self.chunks = plan_chunks([(d, a.numel(), a.element_size()) for d, a in arenas.items()],
                                  [(d, o, _numel(s)) for _, d, o, s in self.targets], self.chunk_bytes)
        self._release()
        try:
            self._prep_handles(info)
        except Exception as exc:
            self._prepared = None
            raise TransferError(f"replica parent {self.parent!r}: preparing READs of its arena failed: {exc!r}") \
                from exc
        self._prepared = (meta, shape)

    def _prep_handles(self, info: dict[str, Any]) -> None:
        agent = self.nixl.agent
        for d, (addr, _, rmem, rdev) in info["arenas"].items():
            local = self.arenas[d]
            lmem, ldev = mem_type(local)
            mine = [c for c in self.chunks if c.dtype == d]
            rh = agent.prep_xfer_dlist(info["agent"], [(addr + c.start, c.nbytes, rdev) for c in mine], rmem)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr() + c.start, c.nbytes, ldev)
                                                           for c in mine], lmem)
            self._dlists += [rh, lh]
            self._handles += [agent.make_prepped_xfer("READ", lh, [i], rh, [i]) for i in range(len(mine))]

    def _release(self) -> None:
        """Drop the READs prepared against the parent's previous memory."""
        agent = self.nixl.agent
        for handle in self._handles:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)
        for dlist in self._dlists:
            with contextlib.suppress(Exception):
                agent.release_dlist_handle(dlist)
        self._handles, self._dlists = [], []

    def read(self, epoch: int, on_landed: Callable[[int], None], deadline: float) -> int:
        """READ every chunk of ``epoch`` as the parent's progress covers it, ``inflight`` at once;
        ``on_landed(bytes)`` after each advance of the checked, landed prefix. Returns the bytes read.

        Raises:
            StaleVersionError: the parent left ``epoch`` (retryable).
            TransferError: a READ failed, the parent abandoned the mirror or stopped beating, or
                the chunks did not all land before ``deadline``."""
        chunks, n = self.chunks, len(self.chunks)
        posted = done = 0
        available = self.parent_landed = self.landed(epoch)
        self.first_read_progress, self.done_bytes = None, 0
        beat, idle = (self._beats.beat_count(self.parent), time.monotonic()), 0
        while done < n:
            moved = False
            while posted < n and posted - done < self.inflight and chunks[posted].end <= available:
                if self.first_read_progress is None:
                    self.first_read_progress = available
                self._post(posted)
                posted, moved = posted + 1, True
            finished = self._finished(done, posted)
            if finished:
                self.check(epoch)  # READs that ended before this saw only epoch `epoch`
                done += finished
                self.done_bytes = chunks[done - 1].end
                on_landed(self.done_bytes)
                moved = True
            elif posted < n and posted - done < self.inflight:
                fresh = self.landed(epoch)
                moved, available = fresh > available, fresh
                self.parent_landed = available
            if moved:
                beat, idle = (self._beats.beat_count(self.parent), time.monotonic()), 0
                continue
            beat = self._alive(beat)
            if time.monotonic() > deadline:
                raise TransferError(f"READ from replica parent {self.parent!r}: {done} of {n} chunks landed "
                                    f"by the deadline")
            idle = idle + 1 if posted == done else 0  # nothing in flight: waiting on the parent's progress
            time.sleep(min(0.001, 0.0001 * 2 ** min(idle, 4)))  # back off there: waiting children poll the store
        return chunks[-1].end if chunks else 0

    def _post(self, i: int) -> None:
        try:
            state = self.nixl.agent.transfer(self._handles[i])
        except Exception as exc:  # nixl raises its own error types (a disconnected peer, ...)
            raise TransferError(f"READ from replica parent {self.parent!r} failed: {exc!r}") from exc
        if state == "ERR":
            raise TransferError(f"READ from replica parent {self.parent!r} reported ERR")

    def _finished(self, done: int, posted: int) -> int:
        """How many posted READs from ``done`` on have ended, in order."""
        agent, k = self.nixl.agent, 0
        for i in range(done, posted):
            try:
                state = agent.check_xfer_state(self._handles[i])
            except Exception as exc:
                raise TransferError(f"READ from replica parent {self.parent!r} failed: {exc!r}") from exc
            if state == "ERR":
                raise TransferError(f"READ from replica parent {self.parent!r} reported ERR")
            if state != "DONE":
                break
            k += 1
        return k


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
