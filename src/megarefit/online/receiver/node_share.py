"""A receiver's part in its node group: pull its share, serve it, copy the rest from node-mates.

A :class:`~megarefit.online.receiver.receiver.RefitReceiver` created with ``node=n`` (``n``
receivers on its host) runs each staged cycle as::

    join       once: the node group (node.py: same host, ``$MEGAREFIT_NODE``), n members
    pieces     its plan's shareable targets (node_split.py), published when they change;
               every active mate's read back
    split      computed alone, the same on every mate (node_split.split_node)
    pull       only the targets it pulls itself (not shared, or shared and its own), from the
               trainers, by layer group, its arena served while it fills (node_staged.py)
    copy       every other shared target of a group READ from the mate that pulled it
               (node_copy.py: the same-host path, never the NICs), once that mate's progress
               covers it, while the next group's READs fly; then the end fence over it all
    serve      its arena published whole (seqlock even: version v whole there)

(A plan processed after the pull, quantized or with value steps, pulls whole, fences, serves
and copies in that order.)

A mate that rewrote its arena during the READ (it began another cycle of the same version) is
READ again once it serves, up to ``REREADS`` times. A mate that does not serve in time (its
heartbeat stood still ``lease`` seconds, or ``timeout`` passed), or keeps rewriting, is left out: this receiver
pulls that mate's share itself in the same cycle, fenced again, and names the mate in
``stats.node_fallbacks``. It also marks the mate as gone in the rendezvous (``node/<key>/gone/
<rid>``, with the mate's heartbeat count): the next splits leave it out until its heartbeat
moves again (a restart), so one death costs one wait. Never a mix: a copied target is of the
version this receiver fenced, or it is pulled again.

Rendezvous records (signed, JSON; never unpickled): ``node/<key>/pieces/<rid>``,
``node/<key>/gone/<rid>``, and the arena records of group ``node-<key>`` (arena.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megarefit.online.receiver.arena import arena_key, publish_arena
from megarefit.online.receiver.cycle import StaleVersionError
from megarefit.online.receiver.node import NodeGroup, NodeIdentity, join_node, node_identity
from megarefit.online.receiver.node_copy import MateReader
from megarefit.online.receiver.node_split import NodePiece, NodeSplit, node_pieces, pieces_from_json, \
    pieces_to_json, split_node
from megarefit.online.receiver.replica_chunks import format_progress
from megarefit.online.receiver.stream import sub_plan
from megarefit.online.store.receivers import ReceiverRegistry
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl_agent import NixlAgent, TransferError

log = logging.getLogger(__name__)

__all__ = ["NodeCopies", "NodeShare"]


@dataclass
class NodeCopies:
    """What one cycle took from node-mates: ``bytes`` READ from them, ``fallbacks`` the mates whose
    share this receiver pulled itself (with why), ``missing`` the targets it still has to pull."""

    bytes: int = 0
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    missing: list[TensorRef] = field(default_factory=list)
    wire_bytes: int = 0  # bytes the fallback pull READ from the trainers
    wait_s: float = 0.0  # seconds waiting for mates to serve the version (their pulls still running)
    read_s: float = 0.0  # seconds of the same-host READs themselves


REREADS = 2  # READs again of a mate that rewrote its arena during one (a new cycle of the same version)


def _read_again_if_rewritten(reader: MateReader, wanted: list, arenas: dict[str, torch.Tensor], version: int,
                             local: Mapping[str, str], out: NodeCopies) -> int:
    """``reader.read_targets``; where the mate rewrote its arena during the READ (it began another cycle of
    ``version``: a torn cycle pulled again, a version pulled twice), that READ's bytes are discarded and the
    ranges READ again once the mate serves the version again, at most ``REREADS`` times."""
    for attempt in range(REREADS + 1):
        try:
            got = reader.read_targets(wanted, arenas, version, local)
            out.wait_s, out.read_s = out.wait_s + reader.wait_s, out.read_s + reader.read_s
            return got
        except StaleVersionError as exc:
            if not exc.retryable or attempt == REREADS:
                raise
            log.info("node-mate %s rewrote its arena during the READ: reading again", reader.mate)
    raise AssertionError("unreachable")


class NodeShare:
    """One receiver's node group state (module docstring).

    Args:
        rendezvous / rid: the job's rendezvous and this receiver's id (its NIXL agent name).
        expected: receivers on this node, this one included (>= 1).
        timeout: seconds to wait for the group, the mates' pieces and each mate's arena.
        lease: seconds a mate's heartbeat may stand still before it is given up.
        identity: the node identity (default: :func:`~megarefit.online.receiver.node.node_identity`
            of ``device``)."""

    def __init__(self, rendezvous: Rendezvous, rid: str, expected: int, *, timeout: float = 60.0,
                 lease: float = 5.0, device: torch.device | str = "cpu", identity: NodeIdentity | None = None):
        self.rendezvous, self.rid, self.expected, self.timeout, self.lease = rendezvous, rid, expected, timeout, lease
        self.identity = identity or node_identity(device)
        self._beats = ReceiverRegistry(rendezvous)
        self._progress = (0, 0)  # (sequence, bytes landed) of the arena served while it fills (serve_filling)
        self.group: NodeGroup | None = None
        self.split: NodeSplit | None = None
        self.pieces: tuple[NodePiece, ...] = ()
        self._base_digest: str | None = None
        self._published: str | None = None
        self._records: dict[str, tuple[bytes, tuple[NodePiece, ...]]] = {}
        self._readers: dict[str, MateReader] = {}
        self._restricted: dict[tuple[str, str], Plan] = {}

    @property
    def name(self) -> str:
        """The group's arena records' name: ``node-<key>``."""
        return f"node-{self.identity.key}"

    def _key(self, kind: str, rid: str) -> str:
        return f"node/{self.identity.key}/{kind}/{rid}"

    def join(self) -> NodeGroup:
        """Join the node group (once; waits for ``expected`` members, :func:`join_node`)."""
        if self.group is None:
            self.group = join_node(self.rendezvous, self.rid, self.identity, self.expected, self.timeout)
        return self.group

    # ---- the split ---------------------------------------------------------------------------------
    def active(self) -> list[str]:
        """The group's members not marked gone (or beating again since), in group order."""
        out = []
        for m in self.join().mates:
            key = self._key("gone", m.rid)
            if m.rid != self.rid and self.rendezvous.store.check([self.rendezvous.prefix + key]):
                if self._beats.beat_count(m.rid) <= int(self.rendezvous.fetch(key)):
                    continue
            out.append(m.rid)
        return out

    def _mate_pieces(self, rid: str, deadline: float) -> tuple[NodePiece, ...]:
        key = self._key("pieces", rid)
        while not self.rendezvous.store.check([self.rendezvous.prefix + key]):
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"node {self.identity.key}: mate {rid!r} published no pieces within "
                                        f"{self.timeout:g} s")
            time.sleep(0.01)
        raw = self.rendezvous.fetch(key)
        if self._records.get(rid, (None,))[0] != raw:
            self._records[rid] = (raw, pieces_from_json(raw))
        return self._records[rid][1]

    def restrict(self, base: Plan, plan: Plan) -> Plan:
        """``plan`` (``base`` with holders chosen) less the targets a node-mate pulls for this
        receiver: the plan it pulls from the trainers. Publishes its pieces first (when changed),
        reads every active mate's, computes the split (``split``).

        Raises:
            RendezvousTimeout: the group did not fill, or a mate published no pieces, within ``timeout``."""
        if base.digest != self._base_digest:
            self.pieces, self._base_digest = node_pieces(base), base.digest
        record = pieces_to_json(self.pieces)
        if record != self._published:
            self.rendezvous.put(self._key("pieces", self.rid), record)
            self._published = record
        deadline = time.monotonic() + self.timeout
        mates = self.active()
        needs = {m: self.pieces if m == self.rid else self._mate_pieces(m, deadline) for m in mates}
        self.split = split_node(needs, mates)
        key = (plan.digest, self.split.digest)
        if key not in self._restricted:
            copied = {p.name for ps in self.split.copies(self.rid, self.pieces).values() for p in ps}
            refs = [r for r in plan.targets if r.name not in copied]
            self._restricted = {key: plan if not copied else sub_plan(plan, refs, digest_of(plan.digest, "node", key[1]))}
        return self._restricted[key]

    # ---- serving and copying -----------------------------------------------------------------------
    def begin(self) -> None:
        """Before this receiver rewrites its arena: its sequence odd (mates must not read it now)."""
        rdzv = self.rendezvous
        if rdzv.store.add(rdzv.prefix + arena_key("seq", self.name, self.rid), 0) % 2 == 0:
            rdzv.store.add(rdzv.prefix + arena_key("seq", self.name, self.rid), 1)

    def serve(self, arenas: dict[str, torch.Tensor], layout: list, version: int, metadata: bytes) -> None:
        """The arena holds this receiver's share of ``version``, fenced: publish it, sequence even."""
        publish_arena(self.rendezvous, self.name, self.rid, arenas, layout, version, metadata)
        rdzv = self.rendezvous
        if rdzv.store.add(rdzv.prefix + arena_key("seq", self.name, self.rid), 0) % 2 == 1:
            rdzv.store.add(rdzv.prefix + arena_key("seq", self.name, self.rid), 1)

    def serve_filling(self, arenas: dict[str, torch.Tensor], layout: list, version: int, metadata: bytes) -> None:
        """Serve the arena while it fills (a streamed receiver's node arena): published with
        nothing landed (progress ``0``), sequence even; mates wait for what they want to land
        (:meth:`landed`). ``layout``: in the order the bytes land."""
        rdzv = self.rendezvous
        seq = rdzv.store.add(rdzv.prefix + arena_key("seq", self.name, self.rid), 0)
        epoch = seq + 1 if seq % 2 else seq  # the sequence mates will see once it is served
        self._progress = (epoch, 0)
        rdzv.put(arena_key("progress", self.name, self.rid), format_progress(epoch, 0))  # (signed, as every record)
        self.serve(arenas, layout, version, metadata)

    def landed(self, nbytes: int) -> None:
        """The first ``nbytes`` of the arena being served (in its layout's order) landed;
        :data:`ABANDONED`: it never will this cycle (mates pull those targets themselves)."""
        self.rendezvous.put(arena_key("progress", self.name, self.rid), format_progress(self._progress[0], nbytes))

    def copy_in(self, plan: Plan, nixl: NixlAgent, arenas: dict[str, torch.Tensor], layout: list,
                version: int) -> NodeCopies:
        """READ every target a mate pulled for this receiver into ``arenas`` (``layout``: this
        arena's ``(name, dtype, element offset, shape)``), mate by mate. A mate that fails is
        left out (module docstring): its targets come back in ``missing``, to pull."""
        if self.split is None:
            return NodeCopies()
        here = {n: o * torch_dtype(d).itemsize for n, d, o, _ in layout}
        return self.copy_targets(plan, nixl, arenas, here, version)

    def copy_targets(self, plan: Plan, nixl: NixlAgent, arenas: dict[str, torch.Tensor], here: Mapping[str, int],
                     version: int, *, only: frozenset[str] | None = None, skip: frozenset[str] = frozenset(),
                     into: Mapping[str, torch.Tensor] | None = None) -> NodeCopies:
        """:meth:`copy_in` of the targets a mate pulled for this receiver, those in ``only`` (default:
        all) of mates not in ``skip``, each to byte ``here[name]`` of ``arenas[dtype]`` (a streamed
        receiver: its ring, for every dtype), or into ``into[name]`` where given (a consumer's tensor,
        registered with ``nixl``: a streamed receiver's direct writes)."""
        into = into or {}
        arenas = {**arenas, **{f"direct:{n}": t for n, t in into.items()}}
        local = {n: f"direct:{n}" for n in into}
        out = NodeCopies()
        refs = {r.name: r for r in plan.targets}
        for mate, pieces in self.copies().items():
            pieces = [p for p in pieces if only is None or p.name in only]
            if not pieces or mate in skip:
                continue
            reader = self._readers.get(mate)
            if reader is None:
                reader = self._readers[mate] = MateReader(self.rendezvous, nixl, group=self.name, mate=mate,
                                                          timeout=self.timeout, lease=self.lease)
            wanted = [(p.name, p.dtype, p.nbytes, 0 if p.name in into else here[p.name]) for p in pieces]
            try:
                out.bytes += _read_again_if_rewritten(reader, wanted, arenas, version, local, out)
            except (RendezvousTimeout, TransferError, StaleVersionError) as exc:
                self._give_up(mate, exc)
                out.fallbacks.append((mate, str(exc)))
                out.missing.extend(refs[p.name] for p in pieces)
        return out

    def copies(self) -> dict[str, list[NodePiece]]:
        """This receiver's pieces another mate pulls, per that mate (none before a split)."""
        return {} if self.split is None else self.split.copies(self.rid, self.pieces)

    def owned(self) -> frozenset[str]:
        """Names of this receiver's shared pieces it pulls for its mates too (none before a split)."""
        if self.split is None:
            return frozenset()
        return frozenset(p.name for p in self.pieces if self.split.owners.get(p.signature) == self.rid)

    def _give_up(self, mate: str, exc: Exception) -> None:
        """Log it, and mark ``mate`` gone (at its heartbeat count) unless it only raced a newer version."""
        log.warning("node %s: receiver %s pulls node-mate %s's share itself this cycle: %s", self.identity.key,
                    self.rid, mate, exc)
        if not isinstance(exc, StaleVersionError):
            self.rendezvous.put(self._key("gone", mate), str(self._beats.beat_count(mate)))

    def to_dict(self) -> Mapping[str, object]:
        """The group, the split's digest and this receiver's shared / own bytes (for logs and stats)."""
        copies = {} if self.split is None else self.split.copies(self.rid, self.pieces)
        return {"group": None if self.group is None else self.group.to_dict(),
                "split": None if self.split is None else self.split.digest,
                "copied_bytes": sum(p.nbytes for ps in copies.values() for p in ps),
                "pieces": len(self.pieces)}
