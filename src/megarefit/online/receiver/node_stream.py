"""Node groups for streamed receivers (``memory_budget`` with ``node``): bounded memory, copies by group.

A streamed receiver holds no whole version, so it cannot serve its ring to node-mates: the ring
is rewritten group after group at the receiver's own pace. It serves a **node arena** instead:
the shared targets it owns in the split (:mod:`.node_split`), about ``S / n`` bytes of the
``S`` its group shares, **served while it fills**. One streamed cycle::

    start        the node arena served for version v with nothing landed (its targets listed
                 in the order the groups land them; progress 0)
    per group k  the group's READs from the trainers into the ring (mates' targets left out);
                 landed -> its owned shared targets copied into the node arena, progress
                 published (mates may READ them now) -> group k + 1's READs posted -> its
                 targets a mate owns READ from that mate's node arena into the ring, once the
                 mate's progress covers them -> checked and handed over as any group
                 (:mod:`.streamed`)

So a receiver copies group ``k`` from its mates while its NICs pull group ``k + 1``. Each receiver
publishes group ``k``'s progress before it waits for its mates' group ``k``: with the groups in
one order (whole layers, the plan's order) no two mates wait on each other. The node arena's
bytes are served before this receiver's end fence; a mate's own end fence covers every trainer
rank, so a rank that wrote while either read it tears the mate's cycle too (reported, never a
silent mix). A mate that fails to serve (its heartbeat stands still, its progress stops until
``timeout``, it gave the arena up, or it rewrote its arena during the READ) is given up for the
rest of the cycle: its targets of group ``k`` are pulled from the trainers into the ring, and
the later groups are prepared again with its targets pulled here (``stats.node_fallbacks``
names it).

Memory: ring + scratch + node arena stay within ``memory_budget``; the ring is cut beside the
node arena (``ReceiverMemory.reserve``), and cut again when a later split gives this receiver a
larger share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megarefit.online.receiver.node_share import NodeCopies, NodeShare
from megarefit.online.receiver.replica_chunks import ABANDONED
from megarefit.online.receiver.stream import StreamGroup, sub_plan
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl import NixlTransport

__all__ = ["NodeStream"]


def _nbytes(plan: Plan, ref: TensorRef) -> int:
    return plan.targets[ref].numel * torch_dtype(plan.targets[ref].dtype).itemsize


class NodeStream:
    """A streamed receiver's node arena and its per-group copies (module docstring).

    ``share``: the receiver's node group (:class:`~.node_share.NodeShare`); ``transport``: its
    transport (the node arena is registered with its agent)."""

    def __init__(self, share: NodeShare, transport: NixlTransport, device: torch.device):
        self.share, self.transport, self.device = share, transport, device
        self.arenas: dict[str, torch.Tensor] = {}  # the node arena, per dtype
        self.buffers: dict[str, torch.Tensor] = {}  # its targets by name, views of it
        self.layout: list[tuple[str, str, int, tuple[int, ...]]] = []  # (name, dtype, element offset, shape)
        self.copies = NodeCopies()  # this cycle's copies from mates (fallbacks, bytes, seconds)
        self._landed: list[int] = []  # per group: bytes of the node arena landed once it has (served order)
        self._key: tuple[str, str] | None = None
        self._excluded: dict[tuple[str, str, frozenset[str]], Plan] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the node arena."""
        return sum(a.numel() * a.element_size() for a in self.arenas.values())

    def split(self, base: Plan, plan: Plan) -> int:
        """This cycle's split (:meth:`NodeShare.restrict`: pieces published, mates' read); returns
        the bytes of node arena it needs. Forgets the last cycle's copies and fallbacks."""
        self.share.restrict(base, plan)
        self.copies = NodeCopies()
        owned = self.share.owned()
        return sum(_nbytes(plan, r) for r in plan.targets if r.name in owned)

    def allocate(self, plan: Plan) -> None:
        """The node arena of this split's owned targets (again only when the plan or split changed)."""
        assert self.share.split is not None
        key = (plan.digest, self.share.split.digest)
        if key == self._key:
            return
        if self.arenas:
            self.transport.release(list(self.arenas.values()))
        owned = self.share.owned()
        refs = [r for r in plan.targets if r.name in owned]
        totals: dict[str, int] = {}
        for r in refs:
            totals[plan.targets[r].dtype] = totals.get(plan.targets[r].dtype, 0) + plan.targets[r].numel
        self.arenas = {d: torch.empty(n, dtype=torch_dtype(d), device=self.device) for d, n in totals.items()}
        at, self.buffers, self.layout = dict.fromkeys(totals, 0), {}, []
        for r in refs:
            meta = plan.targets[r]
            shape = meta.storage_shape or meta.shape
            self.buffers[r.name] = self.arenas[meta.dtype][at[meta.dtype]: at[meta.dtype] + meta.numel].view(shape)
            self.layout.append((r.name, meta.dtype, at[meta.dtype], tuple(shape)))
            at[meta.dtype] += meta.numel
        if self.arenas:
            self.transport.nixl.register(list(self.arenas.values()))  # one call: released together
        self._key = key

    def serve(self, groups: Sequence[StreamGroup], version: int) -> None:
        """Serve the node arena for ``version`` while it fills, its targets listed in the order
        ``groups`` land them (call once the groups are prepared: they are not cut again)."""
        order = {name: k for k, g in enumerate(groups) for name in (r.name for r in g.plan.targets)}
        layout = sorted(self.layout, key=lambda e: order.get(e[0], len(groups)))
        per = [0] * len(groups)
        for name, *_ in layout:
            per[order[name]] += self.buffers[name].numel() * self.buffers[name].element_size()
        self._landed = [sum(per[:k + 1]) for k in range(len(groups))]
        self.share.begin()  # the last version's node arena is rewritten now: mates must not read it
        self.share.serve_filling(self.arenas, layout, version, self.transport.nixl.metadata)

    def abandon(self) -> None:
        """The cycle ended before the node arena filled: mates waiting for it pull those targets."""
        self.share.landed(ABANDONED)

    def _elsewhere(self) -> frozenset[str]:
        """Targets the mates (not given up) fill: the groups do not pull them from the trainers."""
        failed = {m for m, _ in self.copies.fallbacks}
        return frozenset(p.name for m, ps in self.share.copies().items() if m not in failed for p in ps)

    def exclude(self, plans: Sequence[Plan]) -> list[Plan]:
        """Each group's plan less the targets the (still serving) mates fill."""
        assert self.share.split is not None
        elsewhere = self._elsewhere()
        out = []
        for p in plans:
            key = (p.digest, self.share.split.digest, elsewhere & {r.name for r in p.targets})
            if key not in self._excluded:
                keep = [r for r in p.targets if r.name not in elsewhere]
                self._excluded[key] = p if len(keep) == len(p.targets) else sub_plan(
                    p, keep, digest_of(p.digest, "node", key[1], sorted(key[2])))
            out.append(self._excluded[key])
        if len(self._excluded) > 4 * len(plans) + 8:  # (bounded: splits and fallbacks change the keys)
            self._excluded = {k: v for k, v in self._excluded.items() if v in out}
        return out

    def served(self, k: int, group: StreamGroup, bufs: Mapping[TensorRef, torch.Tensor]) -> None:
        """Group ``k`` landed from the trainers (and finished): its owned targets copied from the
        ring into the node arena and served (progress: mates may READ them now)."""
        for ref in group.plan.targets:
            if ref.name in self.buffers:
                self.buffers[ref.name].copy_(bufs[ref])
        if self.device.type == "cuda":  # mates READ them once served
            torch.cuda.synchronize(self.device)
        self.share.landed(self._landed[k])

    def from_mates(self, group: StreamGroup, ring: torch.Tensor, version: int,
                   direct: Mapping[str, torch.Tensor] | None = None) -> NodeCopies:
        """The group's targets a mate owns READ from that mate's node arena into the ring (``direct``:
        by name, the consumer's tensors some land in instead), once the mate's progress covers them
        (mates given up this cycle skipped). Returns what the READs got; ``missing``: targets of mates
        that failed now, to pull."""
        names = frozenset(r.name for r in group.plan.targets)
        here = {r.name: group.offsets[r] for r in group.plan.targets if r in group.offsets}
        dtypes = {m.dtype for m in group.plan.targets.values()}
        failed = frozenset(m for m, _ in self.copies.fallbacks)
        got = self.share.copy_targets(group.plan, self.transport.nixl, dict.fromkeys(dtypes, ring), here, version,
                                      only=names, skip=failed, into=direct)
        c = self.copies
        c.bytes, c.wait_s, c.read_s = c.bytes + got.bytes, c.wait_s + got.wait_s, c.read_s + got.read_s
        c.fallbacks.extend(got.fallbacks)
        return got
