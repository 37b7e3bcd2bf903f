"""One refit cycle, staged or streamed, run over the receiver's parts.

The pipeline asks the fence (:mod:`~megarefit.online.receiver.fence`) what to pull, the plan cache
(:mod:`~megarefit.online.receiver.plan_cache`) how, and the receiver memory
(:mod:`~megarefit.online.receiver.memory`) where, then moves the bytes with the transport::

    staged     fence start -> plan -> prepare -> pull all (+ FP8 / value steps) -> fence end
               -> checksums -> hand every target over (views of the arena); a rank that wrote
               during the pull: pulled again, up to ``retries`` times
    streamed   fence start -> plan -> prepare groups -> per group: land (+ zero fills, FP8 /
               value steps) -> checksums -> hand over, the next group's READs already posted
               where its ring bytes differ -> fence end after the last group (TornUpdateError);
               a rank whose READ fails: the rest re-planned onto other holders, same ring
               (:mod:`~megarefit.online.receiver.streamed`)

``direct`` targets (streamed) land in the consumer's own tensors and are not handed over;
once they hold a version whole, a later cycle patches them with its delta before the groups
stream the other targets (:mod:`~megarefit.online.receiver.delta_direct`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import torch

from megarefit.online.delta.apply import DeltaChoice, DeltaReceiver
from megarefit.online.receiver.arena import arena_key, publish_arena
from megarefit.online.receiver.cycle import CycleStats, Laps, StaleVersionError, TornUpdateError, gc_paused
from megarefit.online.receiver.delta_direct import DirectDelta
from megarefit.online.receiver.failover import Failover
from megarefit.online.receiver.fence import FenceStart, VersionFence
from megarefit.online.receiver.integrity import ChecksumVerifier
from megarefit.online.receiver.memory import ReceiverMemory, StreamRing
from megarefit.online.receiver.node_share import NodeCopies, NodeShare
from megarefit.online.receiver.node_staged import GroupedPull, StagedNodePull, abandon_on_error, overlaps
from megarefit.online.receiver.node_stream import NodeStream
from megarefit.online.receiver.plan_cache import PlanCache
from megarefit.online.receiver.stream import sub_plan
from megarefit.online.receiver.streamed import GroupStream
from megarefit.plan import Plan, digest_of
from megarefit.plan.columns import plan_threads
from megarefit.transport.execute import run_value_step, torch_dtype
from megarefit.transport.nic_meter import NicMeter
from megarefit.transport.nics import NicChoice
from megarefit.transport.nixl import NixlTransport, refuse_late
from megarefit.transport.nixl_agent import TransferError


@contextlib.contextmanager
def naming_the_job(where: str, version: int | None, streamed: bool = False) -> Iterator[None]:
    """A failed transfer names the receiver's job and rendezvous (``where``), the version, and what to do."""
    try:
        yield
    except TransferError as exc:
        raise TransferError(
            f"{where}, pulling version {'latest' if version is None else version}: {exc}. The trainer rank named may "
            "have died or re-registered its memory: check that process, restart it if needed, then refit "
            "again; " + ("groups handed over before it may hold this version: the consumer must not serve until a "
                         "refit completes" if streamed else "nothing pulled in this attempt was handed over"),
            rank=exc.rank) from exc


def staged_stats(pipe: CyclePipeline, plan: Plan, pulled: object, got: int, seconds: dict[str, float], cold: bool,
                 attempt: int) -> CycleStats:
    """A staged cycle's stats; ``pulled``: its prepared plan, or the delta it applied."""
    model_bytes, arena_bytes = pipe.memory.sizes
    checks = {"checked_bytes": pipe._verified[0], "checked_boxes": pipe._verified[1]}
    if isinstance(pulled, DeltaChoice):
        return CycleStats(got, cold, seconds, pulled.nbytes, model_bytes, pulled.nbytes, dict(pipe.counters),
                          arena_bytes, 0, sum(len(r) for r in pulled.reads.values()), attempt,
                          peak_extra_bytes=arena_bytes + pipe.delta.local_bytes, refit="delta",
                          delta_base=pulled.base, delta_tensors=len(pulled.delta), full_tensors=len(pulled.full),
                          changed_elements=pulled.changed, **checks)
    return CycleStats(got, cold, seconds, plan.nbytes, model_bytes, pulled.wire_bytes, dict(pipe.counters),
                      arena_bytes, pulled.scratch_bytes, pulled.descriptors, attempt,
                      peak_extra_bytes=arena_bytes + pulled.scratch_bytes, ipc_bytes=pulled.ipc_bytes,
                      ipc_ranks=len(pipe.transport.ipc.ranks), delta_reason=pipe.delta.reason, **checks)


def _execute(pipe: CyclePipeline, plan: Plan, pulled: object, overlapped: bool, start: FenceStart,
             before: tuple) -> object:
    """Move the bytes ``pulled`` names: a delta, a node pull with its copies beside it (``overlapped``:
    ``pulled`` is the plan less the mates' share; returns a :class:`~.node_staged.GroupedPull`), or a
    prepared plan. A warm full pull (nothing set up since ``before``) teaches the cost model."""
    if isinstance(pulled, DeltaChoice):
        pipe.delta.pull(plan, pulled, pipe.memory.buffers, start.manifests, pipe.read_timeout,
                        stable=functools.partial(pipe.fence.end, start))
        return pulled
    if overlapped:
        assert pipe.node is not None and isinstance(pulled, Plan)
        grouped, pipe.node_copies = pipe.node_pull.pull(
            pipe.transport, pipe.node, plan, pulled, start.manifests, pipe.memory.arenas, pipe.memory.layout,
            pipe.memory.buffers, start.version, timeout=pipe.read_timeout, grace=pipe.timeout)
        if before == pipe._setup_count():  # (the groups' requests were prepared in there)
            pipe.delta.measured("wire", grouped.wire_bytes, grouped.seconds["pull"])
            pipe.delta.measured("full", 0, grouped.seconds["pull"])
        return grouped
    warm = before == pipe._setup_count()
    t_read = time.perf_counter()
    pipe.transport.execute(pulled, pipe.memory.buffers, timeout=pipe.read_timeout, grace=pipe.timeout)
    if warm:  # the cost model learns from pulls, not set-up
        pipe.delta.measured("wire", pulled.wire_bytes, time.perf_counter() - t_read)
        pipe.delta.measured("full", 0, time.perf_counter() - t_read)
    return pulled


def _count_nics(meter: NicMeter | None, nic: NicChoice | None, stats: CycleStats) -> None:
    """The bytes each RDMA port moved during the pull (``nic_bytes``); a warning when the NIC of
    ``nic``'s GPU was passed over or the node's NICs carried unevenly (:mod:`~megarefit.transport.nic_meter`)."""
    if meter is None or nic is None:
        return
    stats.nic_bytes, warning = meter.stop({nic.gpu: max(stats.wire_bytes - stats.ipc_bytes, 0)})
    if warning:
        logging.getLogger(__name__).warning("refit of version %s: %s", stats.version, warning)


class CyclePipeline:
    """Runs refit cycles (see the module docstring) and keeps the last one's :class:`CycleStats`.

    Args:
        fence / plans / memory / transport: the receiver's parts (one set per receiver).
        verifier: checks every pulled box against the trainers' checksums, or ``None``.
        replica_group: the arena is served to replicas of this group (staged only), or ``None``.
        timeout: seconds to wait for manifests, versions and transfers (may be changed between cycles).
        transfer_timeout: seconds one pull's READs may take (from their wait's start; a rank whose
            READs are not done by then fails over, as one whose READ failed); ``None``: ``timeout``.
        node: this receiver's node group part: it pulls its share of what node-mates also need, and
            copies the rest from them (:mod:`~megarefit.online.receiver.node_share`; streamed:
            :mod:`~megarefit.online.receiver.node_stream`).
    """

    def __init__(self, fence: VersionFence, plans: PlanCache, memory: ReceiverMemory, transport: NixlTransport, *,
                 verifier: ChecksumVerifier | None = None, replica_group: str | None = None, timeout: float = 60.0,
                 delta: bool = True, transfer_timeout: float | None = None, node: NodeShare | None = None):
        self.fence, self.plans, self.memory, self.transport = fence, plans, memory, transport
        self.node = node
        self.node_copies = NodeCopies()  # the last staged cycle's copies from node-mates
        self.node_stream = None if node is None or memory.memory_budget is None else NodeStream(
            node, transport, memory.device)  # streamed: the node arena it serves (.node_stream)
        self.node_pull = StagedNodePull()  # staged: the grouped pull beside the mates' copies (node_staged.py)
        self.delta = DeltaReceiver(transport, memory.device, delta)
        self.direct_delta = DirectDelta(self.delta, transport)  # streamed: deltas into the direct targets
        self.verifier = verifier
        self.replica_group = replica_group
        self.timeout, self.transfer_timeout = timeout, transfer_timeout
        self.stats: CycleStats | None = None
        nic = getattr(transport.nixl, "nic", None)  # a GPU receiver on a node with RDMA NICs: bytes per NIC
        self.nics = NicMeter() if nic is not None and nic.port is not None else None
        self._verified = (0, 0)  # (checked bytes, checked boxes) of the last cycle
        self.failover = Failover(fence.rendezvous, plans)
        self._serving = False  # replica_group: this arena is being rewritten (its sequence is odd)

    @property
    def read_timeout(self) -> float:
        """Seconds a pull's READs may take: ``transfer_timeout``, else ``timeout``."""
        return self.timeout if self.transfer_timeout is None else self.transfer_timeout

    @property
    def counters(self) -> dict[str, int]:
        """The transport's counters and ``plans_built``."""
        return {**self.transport.counters, "plans_built": self.plans.plans_built}

    def _setup_count(self) -> tuple[int, int, int]:
        """Plans built, transfer requests and registrations so far: a cycle that changes them is cold."""
        return self.plans.plans_built, self.transport.counters["xfers"], self.transport.counters["registrations"]

    def _plan(self, start: FenceStart, lap: Callable[[str], None]) -> Plan:
        """The cycle's plan, its memory allocated (a new plan, or memory released), the manifests
        checked against it (and the checksums' cover), the ranks connected."""
        plan, new = self.plans.plan_for(start.manifests)
        if self.node_stream is not None:  # the split first: the ring is cut beside this receiver's node arena
            need = self.node_stream.split(self.plans.base, plan)
            if need > self.memory.reserve:
                self.memory.reserve, new = need, True
        if new or not self.memory.holds:  # release() freed the memory of the current plan: allocate again
            if self.replica_group is not None and not self._serving:  # replicas must not read the old arena
                self._bump_replica_seq()
                self._serving = True
            self.memory.allocate(plan, start.manifests)
            self.delta.forget("a new arena")
        if self.node_stream is not None:
            self.node_stream.allocate(plan)
        self.plans.check_manifests(plan, start.manifests)
        if self.verifier is not None:  # every box covered by a published sum, before a byte moves
            self.verifier.require(plan, start.manifests)
        lap("plan")
        self.transport.connect(start.manifests, start.metadata)
        return plan

    # ---- staged ----------------------------------------------------------------
    def staged(self, version: int | None, retries: int) -> Iterator[tuple[str, torch.Tensor]]:
        """A staged cycle: pulled (again, up to ``retries`` times, while a rank wrote during the
        pull) and fenced whole, then every target yielded as a view of the arena.

        Raises:
            StaleVersionError: still rejected after ``retries`` pulls, or not retryable.
            (and what the fence, plan cache, memory and transport raise)"""
        attempt = 0
        failovers = []
        if self.nics is not None:
            self.nics.start()
        self.failover.readmit()
        self.transport.quarantined.sweep()  # memory READs that timed out wrote, once they all ended
        while True:
            try:
                plan, pulled, got, seconds, cold = self._pull(version)
                break
            except StaleVersionError as exc:
                if not exc.retryable or attempt >= retries:
                    raise
                attempt += 1
            except TransferError as exc:  # a rank died or its link failed: its share from other holders
                self._quarantine_late()
                failovers.append(self.failover.fail(exc))
        if self.replica_group is not None:  # the arena holds version `got` whole: serve it
            publish_arena(self.fence.rendezvous, self.replica_group, self.fence.name, self.memory.arenas,
                          self.memory.layout, got, self.transport.nixl.metadata)
            self._bump_replica_seq()
            self._serving = False
        self.stats = staged_stats(self, plan, pulled, got, seconds, cold, attempt)
        self.stats.failovers = tuple(failovers)
        if self.node is not None:
            _with_node(self.stats, self.node_copies)
        self.stats.quarantined_bytes = self.transport.quarantined.nbytes
        _count_nics(self.nics, getattr(self.transport.nixl, "nic", None), self.stats)
        staging = plan.staging
        for ref, tensor in self.memory.buffers.items():
            if ref not in staging:
                yield ref.name, tensor

    def _quarantine_late(self) -> None:
        """READs of the failed pull still in flight (``transport.late``) may land later in the
        arena and scratch: those are held until the READs end, never read again, and the pull
        is retried into fresh ones (:mod:`~megarefit.transport.quarantine`). Without it the
        transport refuses every later pull, naming the ranks."""
        if not self.transport.late or self.memory.quarantine() is None:
            return
        self.delta.forget("READs that timed out may still land in the old arena")
        if self.verifier is not None:
            self.verifier.forget()

    def _bump_replica_seq(self) -> None:
        """Move the arena's seqlock counter for the replicas (odd: being rewritten)."""
        rdzv = self.fence.rendezvous
        rdzv.store.add(rdzv.prefix + arena_key("seq", self.replica_group, self.fence.name), 1)

    def _pull(self, version: int | None) -> tuple[Plan, object, int, dict[str, float], bool]:
        """One attempt: discover, fence, plan, pull into the arena (a delta where the arena holds
        an older version whole and the trainers still keep the way there, else in full),
        re-check (raises StaleVersionError, ``retryable`` where a new attempt can succeed)."""
        refuse_late(self.transport.late)  # before anything is freed or allocated again: READs still land
        lap = Laps()
        seconds = lap.seconds
        before = self._setup_count()
        start = self.fence.start(version, self.timeout, lap)
        with gc_paused(), plan_threads():  # cold: ~10^5 objects and small-array work
            plan = self._plan(start, lap)
            pulled = self.delta.choice(self.fence.rendezvous, plan, start.manifests, start.ranks, start.version)
            overlapped = False
            if isinstance(pulled, str):  # a full pull (why: the delta receiver's reason)
                self.delta.reason = pulled
                mine = plan if self.node is None else self.node.restrict(self.plans.base, plan)  # less the mates' share
                overlapped = self.node is not None and overlaps(plan, self.node)  # copies beside the NIC reads
                pulled = mine if overlapped else self.transport.prepare(mine, start.manifests, self.memory.buffers)
            lap("prepare")
        if self.replica_group is not None and not self._serving:  # replicas must not read the arena now
            self._bump_replica_seq()
            self._serving = True
        if self.node is not None:  # node-mates must not read it now either
            self.node.begin()
        self.memory.wait_consumer()  # the previous cycle's tensors may still be read by queued device work
        with naming_the_job(self.fence.where(), version), abandon_on_error(self.node if overlapped else None):
            pulled = _execute(self, plan, pulled, overlapped, start, before)
            if self.verifier is not None:
                self.verifier.pull(start.manifests, self.read_timeout)
            full = not isinstance(pulled, DeltaChoice)
            quant_s = self._after_pull(plan) if full else 0.0
            lap("pull")
            pull_s = pulled.seconds if isinstance(pulled, GroupedPull) else self.transport.last_seconds
            seconds.update({f"pull.{k}": v for k, v in pull_s.items()} if full else self.delta.seconds)
            if plan.quantize:
                seconds["pull.quantize"] = quant_s
            self.fence.end(start)  # (failing: a grouped pull's arena given up to the mates)
        lap("fence")
        if self.node is not None:  # a delta: its own (small) for every target; it still serves its mates
            self.node_copies = self._from_node_mates(plan, start, version, copy=full,
                                                     copied=self.node_copies if overlapped else None)
            lap("node")  # (of which waiting for mates, and their READs: _with_node)
        if self.verifier is not None:  # after the fence: a mismatch is not a concurrent write
            self._verified = self.verifier.verify(plan, self.memory.buffers, start.manifests, start.version)
            lap("verify")
        self.delta.hold(start.version, plan, start.manifests, self.memory.arenas, self.memory.layout)
        seconds.update({k: v for k, v in self.delta.seconds.items() if k.startswith("held.")})
        return plan, pulled, start.version, seconds, before != self._setup_count()

    def _from_node_mates(self, plan: Plan, start: FenceStart, version: int | None, copy: bool,
                         copied: NodeCopies | None = None) -> NodeCopies:
        """Serve this receiver's fenced arena to its node-mates; ``copy`` (a full pull, split): copy
        theirs in (``copied``: already, beside the pull: :mod:`.node_staged`), and pull here from the
        trainers what a mate failed to serve, fenced again (:mod:`.node_share`)."""
        assert self.node is not None
        if copied is not None:  # served while it filled: now whole
            self.node.landed(sum(a.numel() * a.element_size() for a in self.memory.arenas.values()))
        self.node.serve(self.memory.arenas, self.memory.layout, start.version, self.transport.nixl.metadata)
        if not copy:
            return NodeCopies()
        got = copied if copied is not None else self.node.copy_in(plan, self.transport.nixl, self.memory.arenas,
                                                                  self.memory.layout, start.version)
        if got.missing:
            names = sorted(r.name for r in got.missing)
            sub = sub_plan(plan, got.missing, digest_of(plan.digest, "node-fallback", names))
            prepared = self.transport.prepare(sub, start.manifests, self.memory.buffers)
            with naming_the_job(self.fence.where(), version):
                self.transport.execute(prepared, self.memory.buffers, timeout=self.read_timeout, grace=self.timeout)
            self.fence.end(start)
            got.wire_bytes = prepared.wire_bytes
        return got

    def _after_pull(self, plan: Plan) -> float:
        """The receiver-side steps of a staged pull: FP8 blocks that straddle trainer shards
        (one launch on a GPU) and value steps (vLLM's Mamba A = -exp(A_log)); their seconds."""
        t_quant = time.perf_counter()
        buffers = self.memory.buffers
        if plan.quantize:
            self.memory.quantizer(plan)()
        for t in plan.transforms:
            run_value_step(t, buffers[t.staging], buffers[t.target])
        if plan.quantize and self.memory.device.type == "cuda":
            torch.cuda.synchronize(self.memory.device)
        return time.perf_counter() - t_quant

    # ---- streamed --------------------------------------------------------------
    def streamed(self, version: int | None, torn: list[TornUpdateError] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """A streamed cycle (``memory_budget``): each group is pulled into the ring and its
        tensors handed over before the next group is pulled; the versions and update sequences
        are checked again after the last group. ``torn``: a torn cycle is appended there and
        the iterator ends normally (the consumer finishes its install, e.g. vLLM's reload)
        instead of raising.

        A trainer rank whose READ fails mid-stream is failed over (:mod:`~megarefit.online.receiver.streamed`):
        the groups not yet handed over come from its other holders, ``stats.failovers`` names it.

        Raises:
            TornUpdateError: a rank moved on or wrote during the cycle, after tensors were handed over.
            TransferError: a READ failed and no other rank holds what its rank served (names it).
            MemoryBudgetError: failing over, the new holders' scratch does not fit beside the ring.
            (and what the staged cycle raises before the first tensor)"""
        refuse_late(self.transport.late)  # a ring or direct tensors late READs still write: never freed
        lap = Laps()
        before = self._setup_count()
        self.failover.readmit()
        start = self.fence.start(version, self.timeout, lap)
        with gc_paused(), plan_threads():
            plan = self._plan(start, lap)
        if self.verifier is not None:  # read before the delta's fence check: inside the same seqlock window
            self.verifier.pull(start.manifests, self.read_timeout)
        with naming_the_job(self.fence.where(), version, streamed=True):
            stream = self.memory.stream  # (allocated by _plan)
            self.memory.wait_consumer()  # a delta lands in the ring: the last cycle's copies out of it are done
            try:
                patched, prepared = self._prepare_streamed(plan, stream, start, lap)
            except StaleVersionError as exc:  # a rank wrote during the delta read: nothing handed over
                if torn is None:
                    raise
                torn.append(TornUpdateError(f"{exc}; nothing was handed over", retryable=exc.retryable))
                return
            stream = self.memory.stream  # (re-cut when the scratch needed did not fit beside it)
            cold = before != self._setup_count()
            groups = GroupStream(self, start, plan, prepared, patched=patched)  # fails over a rank whose READ fails
            lap.seconds["pull"] = yield from groups.run()
        lap.restart()
        self._verified = groups.verified
        start, plan, prepared = groups.start, groups.plan, groups.prepared
        error = groups.error or self.fence.torn(start, len(stream.groups))
        if error is not None:
            if torn is None:
                raise error
            torn.append(error)
            return
        lap("fence")
        self.direct_delta.hold(plan, stream, start, lap.seconds["pull"], sum(p.wire_bytes for p in prepared), cold)
        self.stats = streamed_stats(self, plan, stream, prepared, start.version, cold, lap.seconds)
        self.stats.failovers = tuple(groups.failovers)

    def _prepare_streamed(self, plan: Plan, stream: StreamRing | None, start: FenceStart,
                          lap: Callable[[str], None]) -> tuple[bool, list]:
        """(patched, the groups' prepared READs): the direct targets patched with a delta and the rest
        prepared, or every group prepared; in a node group its node arena served as it fills
        (:mod:`.node_stream`).

        Raises:
            StaleVersionError: a rank wrote during the delta read (nothing was handed over)."""
        patch = stream is not None and self.node_stream is None  # (a node group serves whole targets: no patches)
        if patch and self.direct_delta.patch(self.fence, plan, stream, start, self.timeout):
            prepared = self.direct_delta.rest_prepared(plan, stream, start.manifests)  # the rest streams
            lap("prepare")
            return True, prepared
        with gc_paused(), plan_threads():
            prepared = self.memory.prepare_stream(plan, start.manifests, self.node_stream)
        lap("prepare")
        if self.node_stream is not None:  # served while it fills: mates READ each group once it landed
            self.node_stream.serve(self.memory.stream.groups, start.version)
        return False, prepared



def streamed_stats(pipe: CyclePipeline, plan: Plan, stream: StreamRing, prepared: list, got: int, cold: bool,
                   seconds: dict[str, float]) -> CycleStats:
    """A streamed cycle's :class:`CycleStats` (the node group's part: :func:`_with_node`)."""
    scratch = pipe.transport.scratch_allocated
    model_bytes = sum(m.numel * torch_dtype(m.dtype).itemsize for r, m in plan.targets.items()
                      if r not in plan.staging)
    moved, delta = pipe.direct_delta.stats(plan, stream, pipe.memory.direct_bytes())
    stats = CycleStats(got, cold, seconds, moved, model_bytes, sum(p.wire_bytes for p in prepared) + delta.pop("read"),
                       dict(pipe.counters), 0, scratch, sum(p.descriptors for p in prepared), 0,
                       install="streamed", peak_extra_bytes=stream.nbytes + scratch,
                       groups=len(stream.groups), checked_bytes=pipe._verified[0],
                       checked_boxes=pipe._verified[1], direct_bytes=pipe.memory.direct_bytes(),
                       ipc_bytes=sum(p.ipc_bytes for p in prepared), ipc_ranks=len(pipe.transport.ipc.ranks),
                       **delta)
    if pipe.node_stream is not None:
        _with_node(stats, pipe.node_stream.copies)
        stats.peak_extra_bytes += pipe.node_stream.nbytes  # (within the budget: memory.reserve)
    return stats


def _with_node(stats: CycleStats, copies: NodeCopies) -> None:
    """A node group's cycle: the bytes copied from mates and pulled for them, fallbacks, seconds."""
    stats.wire_bytes += copies.wire_bytes
    stats.node_bytes, stats.node_fallbacks = copies.bytes, tuple(copies.fallbacks)
    stats.seconds["node.wait"], stats.seconds["node.read"] = copies.wait_s, copies.read_s


__all__ = ["CyclePipeline", "naming_the_job"]
