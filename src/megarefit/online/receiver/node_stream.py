"""Node groups for streamed receivers (``memory_budget`` with ``node``): bounded memory, copies by group.

A streamed receiver holds no whole version, so it cannot serve its ring to node-mates: the ring
is rewritten group after group at the receiver's own pace. It serves a **node arena** instead:
the shared targets it owns in the split (:mod:`.node_split`), about ``S / n`` bytes of the
``S`` its group shares. One streamed cycle::

    node arena   its owned shared targets pulled from the trainers first, fenced (no rank wrote
                 meanwhile), then served to the group (seqlock even: version v there)
    per group k  the group's other targets READ from the trainers (posted first), and meanwhile
                 its targets a mate owns READ from that mate's node arena into the ring (the
                 same-host path) and its own shared targets copied from its node arena; then
                 checked and handed over as any group (:mod:`.streamed`)

So the same-host copies of group ``k`` overlap its NIC READs, and the end fence covers every
rank read, as for any streamed cycle. A mate that fails to serve (its heartbeat stands still,
``timeout``, or it rewrote its arena during the READ) is given up for the rest of the cycle: its
targets of group ``k`` are pulled from the trainers into the ring, and the later groups are
prepared again with its targets pulled here (``stats.node_fallbacks`` names it).

Memory: ring + scratch + node arena stay within ``memory_budget``; the ring is cut beside the
node arena (``ReceiverMemory.reserve``), and cut again when a later split gives this receiver a
larger share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megarefit.online.receiver.node_share import NodeCopies, NodeShare
from megarefit.online.receiver.stream import StreamGroup, sub_plan
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl import NixlTransport
from megarefit.transport.nixl_requests import PreparedPlan

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
        self.buffers: dict[TensorRef, torch.Tensor] = {}  # its targets, views of it
        self.layout: list[tuple[str, str, int, tuple[int, ...]]] = []  # as served (name, dtype, element offset, shape)
        self.owned_plan: Plan | None = None
        self.copies = NodeCopies()  # this cycle's copies from mates (fallbacks, bytes, seconds)
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
            self.buffers[r] = self.arenas[meta.dtype][at[meta.dtype]: at[meta.dtype] + meta.numel].view(shape)
            self.layout.append((r.name, meta.dtype, at[meta.dtype], tuple(shape)))
            at[meta.dtype] += meta.numel
        if self.arenas:
            self.transport.nixl.register(list(self.arenas.values()))  # one call: released together
        self.owned_plan = sub_plan(plan, refs, digest_of(plan.digest, "node-arena", key[1]))
        self._key = key

    def pull(self, prepared: PreparedPlan, fenced: Callable[[], None], version: int, timeout: float,
             grace: float) -> None:
        """Pull the node arena (``prepared``: its owned plan's READs), check ``fenced`` (no rank
        wrote meanwhile), then serve it to the mates as ``version``.

        Raises:
            StaleVersionError: a rank wrote during the pull (``fenced``; the arena is not served).
            TransferError: a READ failed (not served: mates pull these targets themselves)."""
        assert self.owned_plan is not None
        self.share.begin()  # the node arena is rewritten: mates must not read it now
        self.transport.execute(prepared, self.buffers, timeout=timeout, grace=grace)
        self.copies.wire_bytes += prepared.wire_bytes
        fenced()  # no rank wrote while the node arena was read: it holds ``version``
        self.share.serve(self.arenas, self.layout, version, self.transport.nixl.metadata)

    def _elsewhere(self) -> frozenset[str]:
        """Targets the groups do not pull from the trainers: owned ones, and those of mates not given up."""
        failed = {m for m, _ in self.copies.fallbacks}
        copied = {p.name for m, ps in self.share.copies().items() if m not in failed for p in ps}
        return self.share.owned() | copied

    def exclude(self, plans: Sequence[Plan]) -> list[Plan]:
        """Each group's plan less the targets the node arena and the (still serving) mates fill."""
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

    def land(self, group: StreamGroup, bufs: Mapping[TensorRef, torch.Tensor], ring: torch.Tensor,
             version: int) -> NodeCopies:
        """Group ``group``'s shared targets into the ring: each mate's READ from its node arena
        (mates given up this cycle skipped), its own copied from the node arena. Returns what the
        mates' READs got; ``missing``: targets of mates that failed now, to pull."""
        owned = {r.name: t for r, t in self.buffers.items()}
        names = frozenset(r.name for r in group.plan.targets)
        for ref in group.plan.targets:
            if ref.name in owned:
                bufs[ref].copy_(owned[ref.name])
        here = {r.name: group.offsets[r] for r in group.plan.targets if r in group.offsets}
        dtypes = {m.dtype for m in group.plan.targets.values()}
        failed = frozenset(m for m, _ in self.copies.fallbacks)
        got = self.share.copy_targets(group.plan, self.transport.nixl, dict.fromkeys(dtypes, ring), here, version,
                                      only=names, skip=failed)
        c = self.copies
        c.bytes, c.wait_s, c.read_s = c.bytes + got.bytes, c.wait_s + got.wait_s, c.read_s + got.read_s
        c.fallbacks.extend(got.fallbacks)
        return got
