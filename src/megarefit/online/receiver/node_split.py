"""Node-local dedup, as data: which target tensors node-mates share, and who pulls each (issue 60).

Every receiver of a node plans its own targets (a vLLM worker's shards, or full HF tensors).
Many are byte-for-byte the same on several node-mates: tensors vLLM keeps whole on every TP
rank (norms, routers, MLA's ``fused_qkv_a_proj``), dense tensors across the data-parallel ranks
of a tp1 engine, everything across replicas of an engine smaller than the node. Such a target
crosses the node's NICs once: one mate pulls it from the trainers, the others copy it from that
mate's arena over the same-host path (:mod:`~megarefit.online.receiver.node_copy`).

**A piece's identity is logical.** :func:`node_pieces` names each target by a digest of what
fills it, read from the plan *before* holders were chosen (sources at their coordinate's first
holder, :mod:`megarefit.planner.holders`): the target's shape, dtype and stored shape, and every
op writing it as (source ``(tp, pp, ep)``, source name, source box, target box, transpose). Two
targets with one signature hold the same bytes whichever trainer copy each mate would read, and
the target's name is not part of it (the same bytes may be named differently on two mates).

Targets a receiver produces itself are never shared: FP8 weights and scales quantized on the
receiver, value steps (vLLM's Mamba ``A``), their staging, and targets with zero fills.

**The split** (:func:`split_node`) is computed by every mate alone from every mate's pieces,
and comes out the same on each: the shared signatures, largest first (ties by signature), each
to the needer that was given the fewest bytes so far (ties by place in the group). Pieces only
one mate needs stay with it. Every shared piece has exactly one owner, one of its needers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarefit.errors import MegarefitError
from megarefit.plan import Plan, digest_of
from megarefit.transport.execute import torch_dtype

__all__ = ["NodePiece", "NodeSplit", "node_pieces", "pieces_from_json", "pieces_to_json", "split_node"]


@dataclass(frozen=True)
class NodePiece:
    """One target tensor of a receiver's plan: its ``name`` there, ``dtype``, ``nbytes`` (bytes, its
    stored shape's), and ``signature`` (16 hex digits: what fills it, module docstring)."""

    name: str
    dtype: str
    nbytes: int
    signature: str


def _signature(plan: Plan, ref) -> str:
    meta = plan.targets[ref]
    ops = [[list(op.src.rank)[:3], op.src.name, op.src_box.to_list(), op.dst_box.to_list(), op.transpose]
           for op in plan.ops_by_target[ref]]
    return digest_of(list(meta.shape), meta.dtype, None if meta.storage_shape is None else list(meta.storage_shape),
                     ops)


def node_pieces(base: Plan) -> tuple[NodePiece, ...]:
    """The shareable targets of ``base`` (a plan before holders were chosen), in target order.

    Raises:
        MegarefitError: ``base`` names a source at a data-parallel copy past the first (its
            holders were chosen already: give the plan before, ``PlanCache.base``)."""
    own = base.staging | base.produced.keys()
    out = []
    for ref, meta in base.targets.items():
        if ref in own or meta.zero_fill:
            continue
        ops = base.ops_by_target[ref]
        if any(len(op.src.rank) > 3 for op in ops):
            raise MegarefitError(f"node_pieces: {ref.name} is read from {ops[0].src.rank}, a chosen holder: "
                                 "give the plan before holders were chosen")
        nbytes = meta.numel * torch_dtype(meta.dtype).itemsize
        out.append(NodePiece(ref.name, meta.dtype, nbytes, _signature(base, ref)))
    return tuple(out)


def pieces_to_json(pieces: Sequence[NodePiece]) -> str:
    """A mate's pieces as the JSON record it publishes (data only: never unpickled)."""
    return json.dumps({"format": "megarefit.node-pieces/1",
                       "pieces": [[p.name, p.dtype, p.nbytes, p.signature] for p in pieces]}, separators=(",", ":"))


def pieces_from_json(text: str | bytes) -> tuple[NodePiece, ...]:
    """The inverse of :func:`pieces_to_json`.

    Raises:
        MegarefitError: not such a record (names the format found)."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != "megarefit.node-pieces/1":
        raise MegarefitError(f"not a node-pieces record (format {data.get('format') if isinstance(data, dict) else None!r})")
    return tuple(NodePiece(str(n), str(d), int(b), str(s)) for n, d, b, s in data["pieces"])


@dataclass(frozen=True)
class NodeSplit:
    """Who pulls each shared piece: ``owners`` maps a signature to the mate (receiver id) that
    pulls it from the trainers; ``mates`` the group the split was computed for, in order."""

    mates: tuple[str, ...]
    owners: Mapping[str, str]

    def pulls(self, rid: str, pieces: Sequence[NodePiece]) -> list[str]:
        """Names among ``rid``'s ``pieces`` it pulls itself: not shared, or shared and its own."""
        return [p.name for p in pieces if self.owners.get(p.signature, rid) == rid]

    def copies(self, rid: str, pieces: Sequence[NodePiece]) -> dict[str, list[NodePiece]]:
        """``rid``'s pieces another mate pulls, per that mate (in group order)."""
        out: dict[str, list[NodePiece]] = {m: [] for m in self.mates if m != rid}
        for p in pieces:
            owner = self.owners.get(p.signature, rid)
            if owner != rid:
                out[owner].append(p)
        return {m: v for m, v in out.items() if v}

    @property
    def digest(self) -> str:
        return digest_of(list(self.mates), sorted(self.owners.items()))


def split_node(needs: Mapping[str, Sequence[NodePiece]], mates: Sequence[str]) -> NodeSplit:
    """The split of the pieces more than one of ``mates`` needs (module docstring).

    ``needs[rid]``: mate ``rid``'s pieces; ``mates``: the group in order (each in ``needs``).

    Raises:
        MegarefitError: a mate has no pieces record, or one signature comes with two sizes."""
    missing = [m for m in mates if m not in needs]
    if missing:
        raise MegarefitError(f"split_node: no pieces from node-mates {missing}")
    needers: dict[str, list[str]] = {}
    size: dict[str, int] = {}
    for rid in mates:
        for p in needs[rid]:
            if size.setdefault(p.signature, p.nbytes) != p.nbytes:
                raise MegarefitError(f"split_node: piece {p.signature} ({p.name} on {rid}) is {p.nbytes} bytes, "
                                     f"{size[p.signature]} on another mate: not one piece")
            who = needers.setdefault(p.signature, [])
            if rid not in who:
                who.append(rid)
    place = {m: i for i, m in enumerate(mates)}
    load = dict.fromkeys(mates, 0)
    owners: dict[str, str] = {}
    for sig in sorted((s for s, w in needers.items() if len(w) > 1), key=lambda s: (-size[s], s)):
        owner = min(needers[sig], key=lambda m: (load[m], place[m]))
        owners[sig] = owner
        load[owner] += size[sig]
    return NodeSplit(tuple(mates), owners)
