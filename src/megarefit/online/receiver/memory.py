"""What a receiver holds on its device for the tensors it pulls: an arena, or a ring.

Staged (no memory budget): one **arena** per dtype holds every target of the plan, laid out
in trainer order, between cycles (replicas read it). Streamed (``memory_budget``): one
registered **ring** (:mod:`~megarefit.online.receiver.stream`) shares the budget with the
transport's scratch; each group of layers lands in it in turn. ``direct`` targets are
READ straight into the consumer's own tensors and take no ring bytes::

    staged     arenas {dtype: [target | target | ...]}              + scratch
    streamed   ring   [group 0, 2, ... ->      <- group 1, 3, ...]  + scratch  <= memory_budget

:meth:`ReceiverMemory.release` frees both between cycles; the next cycle allocates again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from megarefit.errors import MissingParameterError, ShapeMismatchError
from megarefit.layout import RankCoord
from megarefit.online.receiver.stream import (
    ALIGN,
    SCRATCH_SHARE,
    MemoryBudgetError,
    StreamGroup,
    budget_for,
    default_memory_budget,
    ring_needed,
    stream_groups,
)
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.quant.fp8 import Fp8Format
from megarefit.quant.kernel import Fp8Quantizer
from megarefit.transport.execute import slots, torch_dtype
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl import DIRECT_MIN_BYTES, NixlTransport, quarantine
from megarefit.transport.nixl_requests import GatherSizes


class NodePart(Protocol):
    """A streamed node group's part in preparing the groups (:class:`~.node_stream.NodeStream`)."""

    def exclude(self, plans: Sequence[Plan]) -> list[Plan]:
        """Each group's plan less the targets the node-mates fill."""
        ...


@dataclass
class StreamRing:
    """A streamed receiver's groups, its ring, per-group target views and FP8 quantizers."""

    groups: list[StreamGroup]
    ring: torch.Tensor  # uint8, registered as one region
    buffers: list[dict[TensorRef, torch.Tensor]]  # per group: its targets as views of the ring
    quantizers: list[Fp8Quantizer | None]  # per group, compiled on first use
    budget: int  # bytes: ring + scratch stay within it
    direct: frozenset[TensorRef] = frozenset()  # targets READ straight into the consumer's tensors (no ring)

    @property
    def nbytes(self) -> int:
        return self.ring.numel()


def quantizer_of(plan: Plan, buffers: Mapping[TensorRef, torch.Tensor]) -> Fp8Quantizer:
    """The receiver-side FP8 steps of ``plan`` (blocks that straddle trainer shards), compiled
    on ``buffers`` (its staging, weight and scale targets)."""
    step = plan.quantize[0]
    return Fp8Quantizer([item for q in plan.quantize for item in slots(
        buffers[q.staging], buffers[q.weight], buffers[q.scale])], Fp8Format(step.block, step.ue8m0))


class ReceiverMemory:
    """The arena or ring of one receiver (see the module docstring).

    Args:
        transport: the receiver's transport: registers the memory; its scratch budget is set
            here for a streamed receiver (1/8 of the memory budget unless ``scratch_budget``).
        device: where the memory lives.
        memory_budget: bytes (or ``"auto"``) for a streamed receiver; ``None``: staged.
        scratch_budget: the scratch budget the receiver was given (``None``: derived).
        direct: ``{target name: the consumer's tensor}`` to READ straight into (streamed).
    """

    def __init__(self, transport: NixlTransport, device: torch.device,
                 memory_budget: int | Literal["auto"] | None = None, scratch_budget: int | None = None,
                 direct: Mapping[str, torch.Tensor] | None = None):
        self.transport = transport
        self.device = device
        self.memory_budget = memory_budget
        self.direct: dict[str, torch.Tensor] = dict(direct or {})
        self._scratch_given = scratch_budget
        self.stream: StreamRing | None = None  # streamed: the groups and ring of the current plan
        self.arenas: dict[str, torch.Tensor] = {}  # staged: per dtype
        self.buffers: dict[TensorRef, torch.Tensor] = {}  # staged: every target, a view of an arena, in plan order
        self.layout: list[tuple[str, str, int, tuple[int, ...]]] = []  # staged: what replicas mirror
        self.sizes = (0, 0)  # (model bytes handed over, arena bytes) of the current plan
        self._quantizer: Fp8Quantizer | None = None  # staged FP8 steps, compiled per plan and buffers
        self.reserve = 0  # streamed: bytes of the budget held outside the ring (a node group's node arena)

    @property
    def holds(self) -> bool:
        """Whether an arena or a ring is allocated (``False`` before the first cycle and after :meth:`release`)."""
        return bool(self.buffers) or self.stream is not None

    def allocate(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        """The ring (streamed) or arena (staged) of ``plan``.

        Raises:
            MemoryBudgetError / MissingParameterError / ShapeMismatchError: see :meth:`ring_for`."""
        self._quantizer = None
        if self.memory_budget is not None:
            self.stream = self.ring_for(plan)
        else:  # the previous plan's arenas: deregistered before they are freed (a quarantine took its own)
            self.transport.release([t for t in self.arenas.values() if self.transport.nixl.registered(t)])
            self.arena_for(plan, manifests)

    def wait_consumer(self) -> None:
        """Wait for the device work the consumer queued on tensors handed over earlier (vLLM's
        copies into its parameters run asynchronously on a GPU), before NIXL overwrites them:
        a READ is not ordered with any CUDA stream. A no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> int:
        """Free the arena or ring and the transport's scratch (after the consumer's queued work);
        returns the bytes freed (0 when nothing is held). The caching allocator keeps the pages
        until ``torch.cuda.empty_cache()``."""
        self.wait_consumer()
        held = list(self.arenas.values()) + ([self.stream.ring] if self.stream is not None else [])
        freed = sum(t.numel() * t.element_size() for t in held)
        self.transport.release([t for t in held if self.transport.nixl.registered(t)])  # none: CUDA IPC only
        freed += self.transport.release_scratch()
        self.arenas, self.buffers, self.stream, self._quantizer = {}, {}, None, None
        return freed

    def quarantine(self) -> int | None:
        """Staged, after a pull whose READs are still in flight (``transport.late``): hand the
        arenas and the scratch to the transport's quarantine (held until those READs end, never
        read again: :mod:`~megarefit.transport.quarantine`); the next cycle allocates fresh ones.
        Returns the bytes held, ``None`` where the transport cannot quarantine (it keeps
        refusing to pull)."""
        if self.stream is not None:
            return None
        registered = [t for t in self.arenas.values() if self.transport.nixl.registered(t)]
        held = quarantine(self.transport, registered, [t for t in self.arenas.values()
                                                       if not any(t is r for r in registered)])
        if held is not None:
            self.arenas, self.buffers, self._quantizer = {}, {}, None
        return held

    def quantizer(self, plan: Plan) -> Fp8Quantizer:
        """Staged: ``plan``'s FP8 steps on the arena, compiled once per allocation."""
        if self._quantizer is None:
            self._quantizer = quantizer_of(plan, self.buffers)
        return self._quantizer

    def group_quantizer(self, k: int) -> Fp8Quantizer:
        """Streamed: group ``k``'s FP8 steps on the ring, compiled on first use."""
        stream = self.stream
        assert stream is not None
        if stream.quantizers[k] is None:
            stream.quantizers[k] = quantizer_of(stream.groups[k].plan, stream.buffers[k])
        return stream.quantizers[k]

    def direct_bytes(self) -> int:
        """Bytes of the current ring's targets READ straight into the consumer's tensors."""
        assert self.stream is not None
        return sum(self.direct[r.name].numel() * self.direct[r.name].element_size() for r in self.stream.direct)

    def direct_refs(self, plan: Plan) -> frozenset[TensorRef]:
        """The plan's targets written straight into the consumer's tensors, checked. A target a
        value or quantize step makes (``plan.produced``: the gated norm's ``w``, a float32
        ``A_log``) is computed on the receiver, not READ: it is not direct, and is handed over
        (installed by copy) as every other target.

        Raises:
            MissingParameterError: a direct name is not a target this receiver hands over.
            ShapeMismatchError: a direct tensor's shape, dtype, device or layout is wrong."""
        by_name = {ref.name: ref for ref in plan.targets if ref not in plan.staging}
        produced = plan.produced
        refs = []
        for name, t in self.direct.items():
            ref = by_name.get(name)
            if ref in produced:
                continue
            if ref is None:
                raise MissingParameterError(f"direct tensor {name!r} is not a target of this receiver's plan "
                                            f"(targets: {sorted(by_name)[:3]}, ...)")
            meta = plan.targets[ref]
            shape = meta.storage_shape or meta.shape
            if (tuple(t.shape) != tuple(shape) or t.dtype != torch_dtype(meta.dtype) or t.device != self.device
                    or not t.is_contiguous()):
                raise ShapeMismatchError(f"direct tensor {name!r}: expected contiguous {list(shape)} "
                                         f"{meta.dtype} on {self.device}, got {list(t.shape)} {t.dtype} on "
                                         f"{t.device} contiguous={t.is_contiguous()}")
            refs.append(ref)
        return frozenset(refs)

    def ring_for(self, plan: Plan, scratch: int | None = None) -> StreamRing:
        """The groups of a streamed refit and its ring, allocated once per plan: the budget less
        ``scratch`` (default: the scratch budget). Contiguous pulls of at least a quarter of the
        scratch budget READ straight into the ring (no scratch).

        Raises:
            MemoryBudgetError: the largest layer does not fit the ring (names a budget a streamed
                refit completes with, the scratch its gathered pulls can need included: see
                :meth:`fitting_budget`)."""
        self.arenas, self.buffers = {}, {}
        budget = default_memory_budget(plan) if self.memory_budget == "auto" else int(self.memory_budget)
        if self._scratch_given is None:
            self.transport.scratch_budget = budget // SCRATCH_SHARE
        self.transport.direct_min_bytes = _direct_min(self.transport.scratch_budget)
        scratch = self.transport.scratch_budget if scratch is None else scratch
        ring_bytes = (budget - scratch - self.reserve) // ALIGN * ALIGN
        direct = self.direct_refs(plan)
        salt = digest_of(sorted((r.name, self.direct[r.name].data_ptr()) for r in direct))
        try:
            groups = stream_groups(plan, ring_bytes, direct, salt)
        except MemoryBudgetError as exc:
            need = exc.ring_bytes_needed
            raise MemoryBudgetError(f"{exc}: memory_budget={budget} (a ring of {ring_bytes} bytes beside "
                                    f"{scratch} bytes of scratch{self._reserved()}) is too small; use "
                                    f"memory_budget >= {self.fitting_budget(plan, need, scratch)}, 'auto', or None "
                                    "for a staged refit", need) from None
        if self.stream is not None:  # a new plan or a re-cut ring: the old ring goes
            self.transport.release([self.stream.ring])
            self.stream = None
        ring = torch.empty(max(ALIGN, *(g.start + g.nbytes for g in groups)), dtype=torch.uint8, device=self.device)
        self.transport.nixl.register([ring])  # one region: READs may span neighbouring targets
        views = [{**g.views(ring), **{r: self.direct[r.name] for r in g.plan.targets if r in direct}} for g in groups]
        return StreamRing(groups, ring, views, [None] * len(groups), budget, direct)

    def _reserved(self) -> str:
        return f" and a node arena of {self.reserve} bytes" if self.reserve else ""

    def prepare_stream(self, plan: Plan, manifests: dict[RankCoord, Manifest], node: NodePart | None = None) -> list:
        """The groups' prepared READs, with the ring and the scratch together within the budget: a
        gathered run that cannot be split may need more scratch than its share of the budget; then
        the ring is cut again, smaller, beside the scratch measured, and if the new groups need more
        again, beside the most any groups can need (:meth:`scratch_bound`); once per plan: prepared
        requests are cached.

        Raises:
            MemoryBudgetError: the scratch the pulls need leaves no room for the largest layer
                (names a budget that fits, as :meth:`ring_for`).

        ``node`` (a streamed node group, :mod:`.node_stream`): each group's plan is the group's
        less what the mates fill."""
        stream = self.stream
        assert stream is not None
        for attempt in range(3):
            plans, buffers = [g.plan for g in stream.groups], stream.buffers
            if node is not None:
                plans = node.exclude(plans)
            prepared = self.transport.prepare_groups(plans, manifests, buffers)
            scratch = self.transport.scratch_allocated
            if stream.nbytes + scratch + self.reserve <= stream.budget:
                return prepared
            if scratch >= stream.budget:
                break
            if attempt:  # the new groups' pulls need more again: cut for the most any groups can need, if it fits
                most = max(scratch, self.scratch_bound(GatherSizes.of(plan, stream.direct), stream.budget))
                if (stream.budget - most - self.reserve) // ALIGN * ALIGN >= ring_needed(plan, stream.direct):
                    scratch = most
            self.stream = stream = self.ring_for(plan, scratch)
        fits = self.fitting_budget(plan, ring_needed(plan, stream.direct), scratch)
        raise MemoryBudgetError(f"memory_budget={stream.budget}: the gathered pulls need {scratch} bytes of scratch "
                                f"beside a ring of {stream.nbytes} bytes{self._reserved()}; use memory_budget >= "
                                f"{fits}, 'auto', or None for a staged refit")

    def prepare_again(self, manifests: dict[RankCoord, Manifest], first: int, plans: list[Plan] | None = None) -> list:
        """The READs of groups ``first`` on (``plans``, default the groups' own: their plans
        changed, a failover moved them to other holders) prepared again in the same ring, one
        entry per group from ``first`` on. Their scratch must fit beside the ring, which was cut
        for the scratch measured before: where it does not, they are prepared again with half the
        scratch budget (more, smaller waves), up to three times; check :meth:`within_budget` after."""
        stream = self.stream
        assert stream is not None
        plans = [g.plan for g in stream.groups] if plans is None else plans
        given = self.transport.scratch_budget
        try:
            for attempt in range(4):
                prepared = self.transport.prepare_groups(plans[first:], manifests, stream.buffers[first:])
                if stream.nbytes + self.transport.scratch_allocated + self.reserve <= stream.budget or not given \
                        or attempt == 3:
                    return prepared
                self.transport.release_scratch()  # (it only grows) these requests too: prepared again
                self.transport.scratch_budget = max(ALIGN, given >> (attempt + 1))
        finally:
            self.transport.scratch_budget = given
        return prepared

    def within_budget(self, what: str) -> None:
        """Check that the ring and the scratch prepared since hold within the memory budget.

        Raises:
            MemoryBudgetError: they do not (the scratch is freed first); names ``what`` prepared them."""
        stream = self.stream
        assert stream is not None
        scratch = self.transport.scratch_allocated
        if stream.nbytes + scratch + self.reserve > stream.budget:
            self.transport.release_scratch()
            raise MemoryBudgetError(f"{what}: the gathered pulls need {scratch} bytes of scratch beside the ring of "
                                    f"{stream.nbytes} bytes{self._reserved()}, more than memory_budget="
                                    f"{stream.budget}; use a larger memory_budget (or 'auto'), or None for a "
                                    "staged refit")

    def scratch_bound(self, sizes: GatherSizes, budget: int) -> int:
        """The most scratch (bytes) the gathered pulls of any groups of the plan of ``sizes`` can
        need under memory budget ``budget`` (its scratch budget and direct-READ threshold)."""
        scratch_budget = budget // SCRATCH_SHARE if self._scratch_given is None else self._scratch_given
        return sizes.scratch_bound(scratch_budget, direct_min_bytes=_direct_min(scratch_budget),
                                   max_direct=self.transport.max_direct, ring_bytes=budget)

    def fitting_budget(self, plan: Plan, need: int, scratch: int = 0) -> int:
        """A memory budget (bytes) a streamed refit of ``plan`` completes with: its first ring
        holds ``need`` bytes (the largest layer) beside the scratch budget, and so does a ring cut
        again beside ``scratch`` or beside the most scratch the gathered pulls can need at that
        budget (:meth:`scratch_bound`, which grows with the budget: the budget is raised step by
        step, from the least that holds the layer, until it holds both)."""
        sizes = GatherSizes.of(plan, self.direct_refs(plan))
        budget = self.reserve + max(budget_for(need), need + max(scratch, self._scratch_given or 0) + ALIGN)
        while True:  # non-decreasing, bounded: the bound grows by about 1/8 of the budget's growth
            fits = max(budget, need + self.scratch_bound(sizes, budget) + self.reserve + ALIGN)
            if fits == budget:
                return budget
            budget = fits

    def arena_for(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        """Allocate the arena (per dtype) holding every target, laid out in trainer order."""
        self.stream = None
        totals: dict[str, int] = {}
        for meta in plan.targets.values():
            totals[meta.dtype] = totals.get(meta.dtype, 0) + meta.numel
        arenas = {d: torch.empty(n, dtype=torch_dtype(d), device=self.device) for d, n in totals.items()}  # per dtype
        at, offsets, views = dict.fromkeys(totals, 0), {}, {}
        for ref in sorted(plan.targets, key=_trainer_order(plan, manifests)):
            meta = plan.targets[ref]
            views[ref] = arenas[meta.dtype][at[meta.dtype]: at[meta.dtype] + meta.numel].view(
                meta.storage_shape or meta.shape)  # as the tensor is stored (a view's storage)
            offsets[ref] = at[meta.dtype]
            at[meta.dtype] += meta.numel
        self.arenas = arenas
        self.layout = [(ref.name, plan.targets[ref].dtype, offsets[ref],
                        plan.targets[ref].storage_shape or plan.targets[ref].shape)
                       for ref in plan.targets if ref not in plan.staging]  # what replicas mirror
        self.buffers = {ref: views[ref] for ref in plan.targets}  # handed over in plan order
        staging = plan.staging
        self.sizes = (sum(m.numel * torch_dtype(m.dtype).itemsize for r, m in plan.targets.items()
                          if r not in staging),
                      sum(a.numel() * a.element_size() for a in arenas.values()))
        for ref, meta in plan.targets.items():
            for box in meta.zero_fill:  # never pulled (vLLM vocab padding rows): zero once
                self.buffers[ref][box.slices()].zero_()


def _direct_min(scratch_budget: int) -> int:
    """A streamed receiver's direct-READ threshold: contiguous pulls of at least a quarter of its
    scratch budget READ straight into the ring (at most :data:`DIRECT_MIN_BYTES`)."""
    return min(DIRECT_MIN_BYTES, max(ALIGN, scratch_budget // 4))


def _trainer_order(plan: Plan, manifests: dict[RankCoord, Manifest]):
    """A sort key: where a target's first bytes live on the trainer. Laying the arena out in
    that order lets neighbouring pulls travel as one descriptor (NixlTransport coalesces)."""
    entries = {r: m.by_name() for r, m in manifests.items()}
    by_target = plan.ops_by_target

    def trainer_order(ref: TensorRef) -> tuple:
        ops = by_target.get(ref, ())
        if not ops or ops[0].src.name not in entries[ops[0].src.rank]:
            return (1,)
        e = entries[ops[0].src.rank][ops[0].src.name]
        return (0, tuple(ops[0].src.rank), e.region, e.addr + ops[0].src_byte_offset)

    return trainer_order


__all__ = ["ReceiverMemory", "StreamRing", "quantizer_of"]
