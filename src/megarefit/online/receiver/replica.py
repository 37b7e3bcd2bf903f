"""Fan-out: receivers that installed a version serve it to replicas with the same target.

A receiver's arena already holds its targets in their final layout, one contiguous
tensor per dtype. A :class:`RefitReceiver` created with ``replica_group=g`` publishes
that arena (NIXL metadata, arena addresses, the targets' offsets) after every pull; a
:class:`ReplicaReceiver` of group ``g`` mirrors it with one READ per dtype arena, so the
trainers' links carry the model once per target group whatever the number of replicas::

    trainers ==READ (plan: thousands of pieces)==> tier 1: RefitReceiver(replica_group=g)
                                                      |  one READ per arena
                                  +-------------------+-------------------+
                                  v                                       v
                     ReplicaReceiver (parent = tier 1)        ReplicaReceiver ...
                                  |  one READ per arena
                                  v
                     ReplicaReceiver (parent = that replica)   (a chain, or a tree of fan-out k)

Each serving arena has a seqlock (``replica_seq/<group>/<id>``): odd while its owner
pulls into it. A replica reads the sequence before and after its READs and re-pulls if it
moved, so it never hands over a mix of two versions. If its parent dies or stops
serving, the replica logs a line and pulls from the trainers through its ``fallback``
receiver (a :class:`RefitReceiver` for the same target), or raises ``TransferError``.
:func:`tree_parent` arranges replicas in registration order into a tree of fan-out ``k``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from megarefit.online.receiver.arena import arena_key, publish_arena, tree_parent
from megarefit.online.receiver.receiver import RefitReceiver, StaleVersionError
from megarefit.online.store.rendezvous import Heartbeat, Rendezvous, RendezvousTimeout
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type

log = logging.getLogger(__name__)


class ReplicaReceiver:
    """Mirrors the arena of receiver ``parent`` in ``group`` (see the module docstring).

    Args:
        rendezvous: the job's rendezvous.
        group: the replica group (replicas of one vLLM target: same tp rank and experts).
        parent: the id (receiver name) of the receiver or replica to read from.
        name: this replica's NIXL agent name and id; with ``serve=True`` it serves its own
            arena to further replicas (a chain or tree).
        fallback: a receiver for the same target that reads the trainers, used when the
            parent fails; ``None``: raise instead.
        device: where the mirrored arena lives.
    """

    def __init__(self, rendezvous: Rendezvous, *, group: str, parent: str, name: str, timeout: float = 60.0,
                 fallback: RefitReceiver | None = None, device: torch.device | str = "cpu", serve: bool = False,
                 retries: int = 2, heartbeat_s: float = 1.0):
        self.rendezvous, self.group, self.parent, self.name = rendezvous, group, parent, name
        self.timeout, self.fallback, self.device, self.serve, self.retries = timeout, fallback, torch.device(device), \
            serve, retries
        self.nixl = NixlAgent(name, progress_thread=serve, device=self.device)
        self.arenas: dict[str, torch.Tensor] = {}
        self.targets: list[tuple[str, str, int, tuple[int, ...]]] = []
        self.version: int | None = None
        self.bytes_read = 0  # bytes READ from the parent in the last cycle
        self.fell_back = False
        self._loaded: bytes | None = None
        self._xfers: list[Any] = []
        self._info: dict[str, Any] | None = None
        self._writing = False
        rendezvous.register_receiver(name)
        self._heartbeat = Heartbeat(rendezvous, name, heartbeat_s)

    def _read_parent(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        key = self.rendezvous.prefix + arena_key("info", self.group, self.parent)
        while not self.rendezvous.store.check([key]):
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"replica parent {self.parent!r} of group {self.group!r} serves no arena "
                                        f"after {self.timeout:.1f} s")
            time.sleep(0.005)
        return json.loads(self.rendezvous.fetch(arena_key("info", self.group, self.parent)))

    def _prepare(self, info: dict[str, Any]) -> None:
        meta = self.rendezvous.fetch(arena_key("meta", self.group, self.parent))
        agent = self.nixl.agent
        if meta != self._loaded:
            if self._loaded is not None:
                agent.remove_remote_agent(info["agent"])
            agent.add_remote_agent(meta)
            self._loaded = meta
            self._info = None
        if self._info is not None and self._info["arenas"] == info["arenas"]:
            return
        for d, (_, numel, _, _) in info["arenas"].items():
            if d not in self.arenas or self.arenas[d].numel() != numel:
                self.arenas[d] = torch.empty(numel, dtype=torch_dtype(d), device=self.device)
        self.nixl.register(list(self.arenas.values()))
        for handle, _ in self._xfers:  # prepared against the parent's previous memory
            with contextlib.suppress(Exception):
                handle.release()
        self._xfers = []
        for d, (addr, numel, rmem, rdev) in info["arenas"].items():
            local = self.arenas[d]
            lmem, ldev = mem_type(local)
            nbytes = numel * local.element_size()
            rh = agent.prep_xfer_dlist(info["agent"], [(addr, nbytes, rdev)], rmem)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), nbytes, ldev)], lmem)
            self._xfers.append((agent.make_prepped_xfer("READ", lh, [0], rh, [0]), nbytes))
        self.targets = [(n, d, o, tuple(s)) for n, d, o, s in info["targets"]]
        self._info = info

    def _seq(self) -> int:
        return self.rendezvous.store.add(self.rendezvous.prefix + arena_key("seq", self.group, self.parent), 0)

    def _pull_once(self) -> int:
        deadline = time.monotonic() + self.timeout
        while (before := self._seq()) % 2:  # the parent is pulling into its arena
            if time.monotonic() > deadline:
                raise StaleVersionError(f"replica parent {self.parent!r} still writing its arena after "
                                        f"{self.timeout:.1f} s")
            time.sleep(0.001)
        info = self._read_parent()
        self._prepare(info)
        agent = self.nixl.agent
        try:
            for handle, _ in self._xfers:
                agent.transfer(handle)
            self._wait(deadline)
        except TransferError:
            raise
        except Exception as exc:  # nixl raises its own error types (a disconnected peer, ...)
            raise TransferError(f"READ from replica parent {self.parent!r} failed: {exc!r}") from exc
        if self._seq() != before:
            raise StaleVersionError(f"replica parent {self.parent!r} rewrote its arena during the pull",
                                    retryable=True)
        self.bytes_read = sum(n for _, n in self._xfers)
        return int(info["version"])

    def _wait(self, deadline: float) -> None:
        agent = self.nixl.agent
        while True:
            states = [agent.check_xfer_state(h) for h, _ in self._xfers]
            if "ERR" in states:
                raise TransferError(f"READ from replica parent {self.parent!r} reported ERR")
            if all(s == "DONE" for s in states):
                break
            if time.monotonic() > deadline:
                raise TransferError(f"READ from replica parent {self.parent!r}: no completion after "
                                    f"{self.timeout:.1f} s")

    def run_refit_cycle(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Mirror the parent's current version and yield ``(name, tensor)`` views of this
        replica's arena (valid until the next cycle; never write them: descendants read this
        arena), in the parent's hand-over order.

        Raises:
            TransferError / RendezvousTimeout: the parent failed and there is no fallback.
            StaleVersionError: the parent kept rewriting its arena past ``retries``.
        """
        self.fell_back = False
        seq_key = self.rendezvous.prefix + arena_key("seq", self.group, self.name)
        try:
            for attempt in range(self.retries + 1):
                if self.serve and not self._writing:  # this arena is about to change: odd
                    self.rendezvous.store.add(seq_key, 1)
                    self._writing = True
                try:
                    self.version = self._pull_once()
                    break
                except StaleVersionError as exc:
                    if not exc.retryable or attempt == self.retries:
                        raise
        except (TransferError, RendezvousTimeout) as exc:
            if self.fallback is None:
                raise
            log.warning("replica %s: parent %r failed (%s); pulling from the trainers instead", self.name,
                        self.parent, exc)
            self.fell_back = True
            yield from self.fallback.run_refit_cycle()
            return
        if self.serve:  # stable again, holding the new version (a failed pull leaves it odd: not served)
            publish_arena(self.rendezvous, self.group, self.name, self.arenas, self.targets, self.version,
                          self.nixl.metadata)
            self.rendezvous.store.add(seq_key, 1)
            self._writing = False
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


__all__ = ["ReplicaReceiver", "publish_arena", "tree_parent"]
