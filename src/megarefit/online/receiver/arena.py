"""Fan-out records: a receiver's arena described in the rendezvous, for its replicas.

A :class:`~megarefit.online.receiver.receiver.RefitReceiver` with a ``replica_group`` publishes
its arena here after every pull (:func:`publish_arena`); a
:class:`~megarefit.online.receiver.replica.ReplicaReceiver` reads it and picks its parent with
:func:`tree_parent`. Keys, under the rendezvous prefix::

    replica_meta/<group>/<id>   NIXL agent metadata of <id>
    replica_info/<group>/<id>       JSON: version, per-dtype arenas, per-target offsets; a
                                    replica's also its epoch (the odd sequence it mirrors under)
    replica_seq/<group>/<id>        seqlock counter: odd while <id> rewrites its arena
    replica_progress/<group>/<id>   a mirroring replica's "<epoch> <bytes landed>" (cut-through:
                                    :mod:`~megarefit.online.receiver.replica_chunks`), or a
                                    streamed node-mate's (:mod:`.node_stream`); signed as every record
"""

from __future__ import annotations

import json

import torch

from megarefit.errors import MegarefitError
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.nixl_agent import mem_type


def arena_key(kind: str, group: str, rid: str) -> str:
    """Rendezvous key of replica record ``kind`` (``meta``, ``info``, ``seq``, ``progress``) of ``rid``
    in ``group``."""
    return f"replica_{kind}/{group}/{rid}"


def publish_arena(rdzv: Rendezvous, group: str, rid: str, arenas: dict[str, torch.Tensor],
                  targets: list[tuple[str, str, int, tuple[int, ...]]], version: int, metadata: bytes,
                  epoch: int | None = None) -> None:
    """Describe ``rid``'s arena for its replicas: per dtype ``(address, elements, memory,
    device)`` in the served order, and per target ``(name, dtype, element offset, shape)`` in
    hand-over order. ``epoch``: the odd sequence a replica mirrors ``version`` under (``None``
    for a receiver, which publishes only once its arena is whole)."""
    info = {"agent": rid, "version": version, **({} if epoch is None else {"epoch": epoch}),
            "arenas": {d: [a.data_ptr(), a.numel(), *mem_type(a)] for d, a in arenas.items()},
            "targets": [[n, d, o, list(s)] for n, d, o, s in targets]}
    rdzv.put(arena_key("meta", group, rid), metadata)
    rdzv.put(arena_key("info", group, rid), json.dumps(info))


def tree_parent(rdzv: Rendezvous, group: str, rid: str, fanout: int) -> str | None:
    """Join ``group`` (registration order) and return the replica ``rid`` should read from
    in a tree of fan-out ``fanout`` (``None``: ``rid`` is the root, it reads the trainers)."""
    if fanout < 1:
        raise MegarefitError(f"fan-out must be >= 1, got {fanout}")
    members = rdzv.join(f"replica_members/{group}", rid)
    i = members.index(rid)
    return None if i == 0 else members[(i - 1) // fanout]


__all__ = ["arena_key", "publish_arena", "tree_parent"]
