"""Same-host copies: byte ranges of a node-mate's arena READ into this receiver's arena (issue 60).

A node-mate that pulled its share of the node's shared bytes serves its arena as a replica
parent does (:mod:`~megarefit.online.receiver.arena`: a :class:`RefitReceiver` with
``replica_group`` set to the node group's name publishes its arena and NIXL metadata after every
pull, under a seqlock that is odd while it rewrites the arena). A :class:`MateReader` copies only
the ranges this receiver needs from it, in one NIXL READ per cycle::

    mate's arena   [....|piece a|.........|piece b|....]      (served, version v, sequence even)
                          |  READ, one descriptor per range       |
    own arena      [..|piece a|....|piece b|..............]    (this receiver pulled the rest itself)

Between the GPUs of one host NIXL's UCX backend copies over CUDA IPC (NVLink); between CPU
processes over shared memory, or over loopback TCP where ``UCX_TLS=tcp`` (the emulated cluster):
never through the node's NICs.

**Never a mix of versions.** A read starts only once the mate's sequence is even and its served
version is the one asked for; the sequence is read again after the READ, and a change (the mate
began rewriting its arena meanwhile) raises ``StaleVersionError(retryable=True)``: the bytes
copied are not handed over.

**Served while it fills** (a streamed mate's node arena, :mod:`.node_stream`): its progress
record ``progress/<group>/<mate>`` (``"<sequence> <bytes landed>"``, in the order its targets
are listed) names the served sequence; a read then waits until the bytes it wants have landed
(or the mate gave the arena up: :data:`~.replica_chunks.ABANDONED`). Such bytes are not fenced
by the mate: the reader's own end fence covers every trainer rank, so a rank that wrote while
the mate read it still tears the reader's cycle, never silently.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.online.receiver.arena import arena_key
from megarefit.online.receiver.cycle import StaleVersionError
from megarefit.online.receiver.replica_chunks import ABANDONED, parse_progress
from megarefit.online.store.receivers import ReceiverRegistry
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type

__all__ = ["MateReader", "RangeCopy"]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class RangeCopy:
    """Copy ``nbytes`` bytes from byte ``src`` of the mate's ``dtype`` arena to byte ``dst`` of
    this receiver's ``dtype`` arena (offsets and sizes in bytes, not elements); ``local``: the key of
    the local tensor instead (a consumer's tensor a streamed receiver writes directly), ``None``: ``dtype``."""

    dtype: str
    src: int
    nbytes: int
    dst: int
    local: str | None = None


class MateReader:
    """Reads ranges of node-mate ``mate``'s served arena (group ``group``) into local arenas.

    ``nixl``: this receiver's agent (its arenas registered with it: they are the READ's local side).
    ``timeout``: seconds to wait for the mate to serve the version and for the READ to end.
    ``lease``: seconds the mate's heartbeat may stand still while this waits (``None``: no check).

    Raises (:meth:`read`):
        RendezvousTimeout: the mate served no arena, or not ``version``, within ``timeout``.
        StaleVersionError: the mate serves a newer version (not retryable), or rewrote its arena
            during the READ (retryable).
        TransferError: a range lies outside the mate's or this receiver's arena, or the READ
            failed or did not end within ``timeout``; the mate's heartbeat stood still ``lease`` s."""

    def __init__(self, rendezvous: Rendezvous, nixl: NixlAgent, *, group: str, mate: str, timeout: float = 60.0,
                 lease: float | None = None):
        self.rendezvous, self.nixl, self.group, self.mate, self.timeout = rendezvous, nixl, group, mate, timeout
        self.lease, self._beats = lease, ReceiverRegistry(rendezvous)
        self._loaded: bytes | None = None
        self._known: tuple[int, dict[str, Any], int] | None = None  # (sequence, info, seq loaded) the mate served
        self._names: set[str] = set()  # remote agents loaded so far
        self.bytes_read = 0  # bytes READ from the mate by the last read()
        self.wait_s = self.read_s = 0.0  # the last read(): seconds waiting for the mate to serve, then READing

    def _key(self, kind: str) -> str:
        return arena_key(kind, self.group, self.mate)

    def _seq(self) -> int:
        return self.rendezvous.store.add(self.rendezvous.prefix + self._key("seq"), 0)

    def _served(self, version: int, deadline: float) -> tuple[int, dict[str, Any]]:
        """The mate's (even sequence, arena info) once it serves ``version``."""
        known = self._known
        if known is not None and known[1]["version"] == version and self._seq() == known[0]:
            return known[0], known[1]  # the same arena as the last READ (a streamed cycle's next group)
        beat = self._beats.beat_count(self.mate), time.monotonic()
        while True:
            if self.lease is not None:
                beat = self._alive(beat)
            seq = self._seq()
            if seq % 2 == 0 and self.rendezvous.store.check([self.rendezvous.prefix + self._key("info")]):
                info = json.loads(self.rendezvous.fetch(self._key("info")))
                if info["version"] == version and self._seq() == seq:
                    self._known = (seq, info, -1)
                    return seq, info
                if info["version"] > version:
                    raise StaleVersionError(f"node-mate {self.mate!r} serves version {info['version']}, "
                                            f"newer than the {version} asked for")
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"node-mate {self.mate!r} (group {self.group!r}) did not serve version "
                                        f"{version} within {self.timeout:g} s (sequence {seq})")
            time.sleep(0.001)

    def _alive(self, beat: tuple[int, float]) -> tuple[int, float]:
        """(beat count, when it last moved); raises TransferError once it stood still ``lease`` s."""
        now, count = time.monotonic(), self._beats.beat_count(self.mate)
        if count != beat[0]:
            return count, now
        if self.lease is not None and now - beat[1] > self.lease:
            raise TransferError(f"node-mate {self.mate!r} (group {self.group!r}) stopped beating: no heartbeat "
                                f"for {now - beat[1]:.1f} s (lease {self.lease:g} s); it died or hangs")
        return beat

    def _descriptors(self, copies: Sequence[RangeCopy], arenas: dict[str, torch.Tensor],
                     info: dict[str, Any]) -> tuple[list, list, str, str]:
        remote, local, rmems, lmems = [], [], set(), set()
        for c in copies:
            if c.dtype not in info["arenas"] or (c.local or c.dtype) not in arenas:
                raise TransferError(f"node-mate {self.mate!r}: no {c.dtype} arena on both sides for {c}")
            addr, numel, rmem, rdev = info["arenas"][c.dtype]
            mine, theirs = arenas[c.local or c.dtype], numel * torch_dtype(c.dtype).itemsize  # (here: a byte ring?)
            if c.src < 0 or c.nbytes <= 0 or c.src + c.nbytes > theirs \
                    or c.dst < 0 or c.dst + c.nbytes > mine.numel() * mine.element_size():
                raise TransferError(f"node-mate {self.mate!r}: {c} lies outside the {c.dtype} arenas "
                                    f"({theirs} bytes there, {mine.numel() * mine.element_size()} here)")
            lmem, ldev = mem_type(mine)
            remote.append((addr + c.src, c.nbytes, rdev))
            local.append((mine.data_ptr() + c.dst, c.nbytes, ldev))
            rmems.add(rmem)
            lmems.add(lmem)
        if len(rmems) != 1 or len(lmems) != 1:
            raise TransferError(f"node-mate {self.mate!r}: arenas of several memory kinds ({rmems}, {lmems}) in one READ")
        return remote, local, rmems.pop(), lmems.pop()

    def read(self, copies: Sequence[RangeCopy], arenas: dict[str, torch.Tensor], version: int) -> int:
        """Copy ``copies`` of the mate's ``version`` into ``arenas``; returns the bytes READ."""
        if not copies:
            self.bytes_read, self.wait_s, self.read_s = 0, 0.0, 0.0
            return 0
        seq, info, deadline = self._wait_served(version)
        return self._read(copies, arenas, seq, info, deadline)

    def _wait_served(self, version: int) -> tuple[int, dict[str, Any], float]:
        """(even sequence, arena info, deadline) once the mate serves ``version``; ``wait_s`` set."""
        self.bytes_read, self.read_s = 0, 0.0
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        seq, info = self._served(version, deadline)
        self.wait_s = time.perf_counter() - t0
        return seq, info, deadline

    def read_targets(self, wanted: Sequence[tuple[str, str, int, int]], arenas: dict[str, torch.Tensor],
                     version: int, local: Mapping[str, str] | None = None) -> int:
        """Copy whole targets of the mate's ``version`` into ``arenas``: ``wanted`` is ``(name, dtype,
        bytes, byte offset here)``, each found by name among the targets the mate serves (their
        offsets published with its arena); ``local``: per name, the key in ``arenas`` of the tensor it
        lands in (default its dtype's arena); returns the bytes READ.

        Raises:
            TransferError: the mate serves no such target, or with another dtype or size.
            (and what :meth:`read` raises)"""
        if not wanted:
            self.bytes_read, self.wait_s, self.read_s = 0, 0.0, 0.0
            return 0
        seq, info, deadline = self._wait_served(version)
        served = {n: (d, o, s) for n, d, o, s in info["targets"]}
        self._wait_landed(seq, info, {w[0] for w in wanted}, deadline)
        copies = []
        for name, dtype, nbytes, dst in wanted:
            if name not in served or served[name][0] != dtype:
                raise TransferError(f"node-mate {self.mate!r} serves no {dtype} target {name!r} "
                                    f"({'not served' if name not in served else served[name][0]})")
            d, offset, shape = served[name]
            size = torch_dtype(d).itemsize
            if _numel(shape) * size != nbytes:
                raise TransferError(f"node-mate {self.mate!r} serves {name!r} as {shape} ({_numel(shape) * size} "
                                    f"bytes), {nbytes} bytes expected here")
            copies.append(RangeCopy(d, offset * size, nbytes, dst, None if local is None else local.get(name)))
        return self._read(copies, arenas, seq, info, deadline)

    def _wait_landed(self, seq: int, info: dict[str, Any], names: set[str], deadline: float) -> None:
        """Where the mate serves its arena while it fills (a progress record of sequence ``seq``):
        wait until every target of ``names`` landed (``wait_s`` grows).

        Raises:
            TransferError: the mate gave the arena up, or its heartbeat stood still ``lease`` s.
            RendezvousTimeout: they did not land by ``deadline``."""
        need, at = 0, 0
        for n, d, _, shape in info["targets"]:
            at += _numel(shape) * torch_dtype(d).itemsize
            if n in names:
                need = at
        key, t0, beat = self.rendezvous.prefix + self._key("progress"), time.perf_counter(), None
        while True:
            if not self.rendezvous.store.check([key]):
                return  # never served while filling: whole once served
            epoch, landed = parse_progress(self.rendezvous.fetch(self._key("progress")))  # (signed)
            if epoch != seq or landed >= need:
                break  # (another sequence: an arena served whole)
            if landed == ABANDONED:
                raise TransferError(f"node-mate {self.mate!r} gave its node arena up mid-cycle")
            beat = self._alive(beat or (self._beats.beat_count(self.mate), time.monotonic()))
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"node-mate {self.mate!r}: {need - landed} bytes of the targets wanted "
                                        f"had not landed in its node arena within {self.timeout:g} s")
            time.sleep(0.0005)
        self.wait_s += time.perf_counter() - t0

    def _read(self, copies: Sequence[RangeCopy], arenas: dict[str, torch.Tensor], seq: int, info: dict[str, Any],
              deadline: float) -> int:
        t0 = time.perf_counter()
        remote, local, rmem, lmem = self._descriptors(copies, arenas, info)
        try:
            self._load(info["agent"], seq)
            self._transfer(info["agent"], remote, local, rmem, lmem, deadline)
        except TransferError:
            raise
        except Exception as exc:  # NIXL's own errors: a mate gone, metadata it cannot load
            self._loaded, self._known = None, None  # loaded again next time
            raise TransferError(f"READ of {len(copies)} ranges from node-mate {self.mate!r} failed: {exc!r}") from exc
        if self._seq() != seq:
            raise StaleVersionError(f"node-mate {self.mate!r} rewrote its arena during the READ", retryable=True)
        self.bytes_read = sum(c.nbytes for c in copies)
        self.read_s = time.perf_counter() - t0
        return self.bytes_read

    def _load(self, name: str, seq: int) -> None:
        """The mate's current NIXL metadata loaded (an older one of the same agent removed first);
        not fetched again while the mate serves the arena (sequence ``seq``) it was loaded for."""
        if self._known is not None and self._known[0] == seq and self._known[2] == seq:
            return
        meta = self.rendezvous.fetch(self._key("meta"))
        if meta == self._loaded:
            return
        agent = self.nixl.agent
        if name in self._names:
            with contextlib.suppress(Exception):  # (already gone)
                agent.remove_remote_agent(name)
        agent.add_remote_agent(meta)
        self._names.add(name)
        self._loaded = meta
        if self._known is not None and self._known[0] == seq:
            self._known = (seq, self._known[1], seq)

    def _transfer(self, name: str, remote: list, local: list, rmem: str, lmem: str, deadline: float) -> None:
        """One READ of every ``remote`` -> ``local`` descriptor, waited for until ``deadline``."""
        agent = self.nixl.agent
        rh = agent.prep_xfer_dlist(name, remote, rmem)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, lmem)
        idx = list(range(len(remote)))
        handle = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
        try:
            agent.transfer(handle)
            polls = 0
            while (state := agent.check_xfer_state(handle)) != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise TransferError(f"READ of {len(remote)} ranges from node-mate {self.mate!r}: "
                                        f"{'ERR' if state == 'ERR' else f'no completion after {self.timeout:g} s'}")
                polls += 1
                if polls > 64:  # (a streamed receiver's own trainer READs fly meanwhile: leave them the CPU)
                    time.sleep(0.0001)
        finally:
            if agent.check_xfer_state(handle) != "PROC":  # a READ still in flight keeps its handles
                agent.release_xfer_handle(handle)
                agent.release_dlist_handle(lh)
                agent.release_dlist_handle(rh)
