"""Node groups: the receivers that share one host find each other through the rendezvous (issue 60).

Receivers on one host can copy bytes from each other's arenas over the same-host path (NIXL between
processes: CUDA IPC between the GPUs of a node, shared memory on CPU) instead of each pulling them
over its own NIC. The first step is knowing who the node-mates are::

    identity = node_identity(device)          # what every process of this host shares
    group = join_node(rendezvous, rid, identity, expected=8, timeout=60)
    group.mates                               # the first 8 to join, in joining order (same for all)
    group.index                               # this receiver's place in it

**What makes two processes node-mates.** They share a kernel (``/proc/sys/kernel/random/boot_id``),
an IPC namespace (CUDA IPC and POSIX shared memory need it) and a network namespace (``/proc/self/ns/
ipc`` and ``net`` inodes): processes in one container, or on one host without containers. Processes
in containers of one host that do not share these are not node-mates (they cannot map each other's
memory). ``$MEGAREFIT_NODE`` overrides the key where a launcher knows better (the emulated cluster
gives each namespace-node its name).

**Records.** Each member's record (``rid``, GPU UUID, device) is a record of the job's rendezvous:
signed with the job secret, parsed as JSON, never unpickled. Membership is an append-only list
(:meth:`~megarefit.online.store.rendezvous.Rendezvous.join`), so every member that waits for
``expected`` members sees the same first ``expected`` in the same order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megarefit.errors import MegarefitError
from megarefit.online.store.records import RendezvousTimeout

__all__ = ["NODE_ENV", "NodeGroup", "NodeIdentity", "NodeMember", "join_node", "node_identity"]

NODE_ENV = "MEGAREFIT_NODE"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_NAMESPACES = ("ipc", "net")


@dataclass(frozen=True)
class NodeIdentity:
    """What this process shares with its node-mates.

    ``key``: 16 hex digits of sha256 over the boot id and the IPC / network namespace inodes, or
    ``$MEGAREFIT_NODE`` as given; ``source``: ``"kernel"`` or ``"MEGAREFIT_NODE"``; ``gpu_uuid``:
    the CUDA device's UUID (``None`` on CPU); ``device``: the CUDA index (``None`` on CPU)."""

    key: str
    source: str
    gpu_uuid: str | None = None
    device: int | None = None


@dataclass(frozen=True)
class NodeMember:
    """One member of a node group: its receiver id, GPU UUID and CUDA index (``None`` on CPU)."""

    rid: str
    gpu_uuid: str | None
    device: int | None


@dataclass(frozen=True)
class NodeGroup:
    """The receivers of one node: ``mates`` in joining order (the same list for every member),
    ``index`` this receiver's place in it, ``key`` the node's identity key."""

    key: str
    mates: tuple[NodeMember, ...]
    index: int

    @property
    def me(self) -> NodeMember:
        return self.mates[self.index]

    def to_dict(self) -> dict:
        return {"key": self.key, "index": self.index, "mates": [vars(m) for m in self.mates]}


def _kernel_key() -> str:
    parts = [Path("/proc/sys/kernel/random/boot_id").read_text().strip()]
    parts += [f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}" for ns in _NAMESPACES]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def node_identity(device: torch.device | str | None = None) -> NodeIdentity:
    """This process's node identity (module docstring), with ``device``'s GPU UUID where it is CUDA.

    Raises:
        MegarefitError: ``$MEGAREFIT_NODE`` is not 1-64 of ``A-Z a-z 0-9 _ . : -``; the kernel's
            boot id or namespaces cannot be read (not Linux) and ``$MEGAREFIT_NODE`` is unset."""
    given = os.environ.get(NODE_ENV)
    if given is not None and not _NAME.match(given):
        raise MegarefitError(f"${NODE_ENV}={given!r}: give 1-64 characters of A-Z a-z 0-9 _ . : - "
                             "(the same name on every process of one node)")
    if given is not None:
        key, source = given, NODE_ENV
    else:
        try:
            key, source = _kernel_key(), "kernel"
        except OSError as exc:
            raise MegarefitError(f"node identity: cannot read the boot id or namespaces ({exc}); set "
                                 f"${NODE_ENV} to the same name on every process of one node") from exc
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return NodeIdentity(key, source)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return NodeIdentity(key, source, str(torch.cuda.get_device_properties(index).uuid), index)


def _record(rendezvous, key: str, rid: str) -> NodeMember:
    raw = json.loads(rendezvous.fetch(f"node/{key}/member/{rid}").decode())
    mate = NodeMember(rid=str(raw["rid"]), gpu_uuid=raw.get("gpu_uuid"), device=raw.get("device"))
    if mate.rid != rid:
        raise MegarefitError(f"node {key}: the record of receiver {rid!r} names {mate.rid!r}; a foreign record")
    return mate


def join_node(rendezvous, rid: str, identity: NodeIdentity, expected: int, timeout: float = 60.0,
              poll: float = 0.05) -> NodeGroup:
    """Join this node's group and wait until ``expected`` receivers joined it.

    ``expected``: how many receivers share the node (e.g. the vLLM workers on it), >= 1.
    ``timeout``: seconds to wait for them. Returns the first ``expected`` members in joining
    order; a receiver that joins again (same ``rid``, restarted) keeps its place.

    Raises:
        MegarefitError: ``expected`` < 1; ``rid`` is not among the first ``expected`` (the group is
            full: another receiver took the place; names the members).
        RendezvousTimeout: fewer than ``expected`` joined within ``timeout``; names who joined."""
    if not isinstance(expected, int) or expected < 1:
        raise MegarefitError(f"join_node: expected={expected!r}; give the number of receivers on this node (>= 1)")
    rendezvous.put(f"node/{identity.key}/member/{rid}",
                   json.dumps({"rid": rid, "gpu_uuid": identity.gpu_uuid, "device": identity.device}))
    members = rendezvous.join(f"node/{identity.key}", rid)
    deadline = time.monotonic() + timeout
    while len(members) < expected:
        if time.monotonic() > deadline:
            raise RendezvousTimeout(f"node {identity.key} ({identity.source}): {len(members)} of {expected} receivers "
                                    f"joined within {timeout:g} s: {members}. Start every receiver of the node, or "
                                    "give expected= the number that runs there")
        time.sleep(poll)
        members = rendezvous.members(f"node/{identity.key}")
    first = members[:expected]
    if rid not in first:
        raise MegarefitError(f"node {identity.key}: receiver {rid!r} joined a full group of {expected}: {first}. "
                             "A receiver restarted under a new name takes no place: restart it under its old one")
    return NodeGroup(identity.key, tuple(_record(rendezvous, identity.key, r) for r in first), first.index(rid))
