"""Online refit: discover trainer ranks, fence versions, plan once, pull over NIXL.

``RefitReceiver.run_refit_cycle(version)`` runs one refit cycle::

    discover   read every rank's manifest (parsed again only when its bytes change)
    version    wait until every rank publishes ``version``; mixed versions past the
               timeout raise VersionMismatchError naming each rank's version
    plan       plan from shapes, cached by layout digest (a layout change re-plans)
    prepare    target arena + scratch allocated and registered once; one prepared
               READ per source rank, re-posted on warm cycles
    pull       post all READs, wait (``pull.read``), scratch copies for strided
               targets (``pull.scratch``)
    fence      versions and update sequences re-read: if any rank moved on or began an
               update during the pull (``Publisher.updating``: a seqlock), the pull is
               rejected before a single tensor is handed over and pulled again, up to
               ``retries`` times, then StaleVersionError names the ranks

Then it yields ``(hf_name, tensor)`` views of the arena, valid until the next
cycle (vLLM's ``load_weights`` copies them). They are the receiver's own memory and read-only
by contract: read or copy them, never write them. A write is seen before the next delta (the
arena's fingerprint, :mod:`~megarefit.online.delta.held`), which then pulls in full and says why.

:class:`RefitReceiver` is a facade over named parts, one module each::

    fence            VersionFence     discover, wait stable / version, fence start / end (seqlock)
    plan_cache       PlanCache        a plan per layout and placement, manifests checked against it
    receiver_memory  ReceiverMemory   the arena (staged) or ring (streamed), direct targets, release
    pipeline         CyclePipeline    the staged and streamed cycles over the parts, their CycleStats
    streamed         GroupStream      one streamed cycle's groups, a failed rank failed over mid-stream
    cycle            the errors (re-exported here), CycleStats, the stage timer
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from megarefit.errors import LayoutError, MegarefitError
from megarefit.online.delta.apply import DeltaReceiver
from megarefit.online.receiver.cycle import CycleStats, StaleVersionError, TornUpdateError, VersionMismatchError
from megarefit.online.receiver.fence import VersionFence
from megarefit.online.receiver.integrity import ChecksumVerifier
from megarefit.online.receiver.memory import ReceiverMemory, StreamRing
from megarefit.online.receiver.node_share import NodeShare
from megarefit.online.receiver.pipeline import CyclePipeline
from megarefit.online.receiver.plan_cache import PlanCache
from megarefit.online.receiver.prefetch import PrefetchSlot, PrefetchState, Prepare, refuse_streamed
from megarefit.online.store.rendezvous import Heartbeat, Rendezvous
from megarefit.plan import Plan
from megarefit.planner import plan_megatron_to_hf
from megarefit.planner.holders import Reader
from megarefit.planner.megatron_to_hf import MODEL_PARTS, ModelPart
from megarefit.targets import VllmTarget
from megarefit.transport.boxcopy import BoxCopies
from megarefit.transport.cuda_ipc import IpcMode, IpcSources
from megarefit.transport.nixl import NixlTransport


def _check_options(memory_budget: int | Literal["auto"] | None, replica_group: str | None,
                   experts: frozenset[int] | None, target: VllmTarget | None, part: str,
                   direct: Mapping[str, torch.Tensor] | None, node: int | None = None) -> None:
    """Refuse receiver options that contradict each other (see :class:`RefitReceiver`).

    Raises:
        MegarefitError / LayoutError: names the options and what to give instead."""
    if memory_budget is not None and replica_group is not None:
        raise MegarefitError("a replica group serves the receiver's whole arena; a streamed receiver "
                             "(memory_budget) keeps none: give one or the other")
    if memory_budget is not None and memory_budget != "auto" and (
            not isinstance(memory_budget, int) or memory_budget <= 0):
        raise MegarefitError(f"memory_budget must be a positive number of bytes, 'auto' or None, "
                             f"got {memory_budget!r}")
    if experts is not None and target is not None:
        raise LayoutError("a vLLM-sharded target carries its own expert placement (VllmTarget expert_parallel / "
                          "expert_map): give experts or target, not both")
    if part not in MODEL_PARTS or (target is not None and part != "all"):
        raise MegarefitError(f"part={part!r}: expected one of {MODEL_PARTS}, and 'all' with a vLLM target "
                             "(VllmTarget(draft=True) picks a worker's draft model)")
    if node is not None and (not isinstance(node, int) or isinstance(node, bool) or node < 1):
        raise MegarefitError(f"node={node!r}: give the number of receivers on this node (>= 1), or None")
    if direct and memory_budget is None:
        raise MegarefitError("direct writes need a streamed refit (memory_budget=...): a staged refit leaves "
                             "the consumer's tensors untouched until every byte is fenced")


_KEPT_FOR_LATE_READS: list[tuple[object, object]] = []  # closed receivers' memory late READs may write


def _closed(heartbeat: Any, transport: NixlTransport, memory: ReceiverMemory) -> None:
    """Stop the heartbeat. Where READs that timed out may still land (``transport.late``, a
    quarantine), the transport and memory are kept alive for the process's life: never freed
    under a READ."""
    heartbeat.stop()
    if transport.late or transport.quarantined.held:
        _KEPT_FOR_LATE_READS.append((transport, memory))


class RefitReceiver:
    """Receives trainer weights; see the module docstring.

    Args:
        rendezvous: where trainer ranks publish manifests and versions.
        name: this receiver's NIXL agent name (unique per receiver process).
        timeout: seconds to wait for manifests, versions and transfers.
        transfer_timeout: seconds one pull's READs may take (a straggler whose READs are not done
            by then fails over, :mod:`.failover`); ``None`` (default): ``timeout``.
        experts: global routed experts this receiver owns (vLLM expert
            parallelism); it pulls only those experts' tensors. ``None``: all.
        target: a vLLM tensor-parallel worker (:class:`~megarefit.targets.VllmTarget`):
            pull only that worker's own parameter shards, under vLLM parameter names
            (``qkv_proj``, ``gate_up_proj``, ``w13_weight``, ``fused_qkv_a_proj``, ...) and
            only its experts; ``VllmTarget(draft=True)``: the worker's MTP draft model's.
            ``None``: full HF tensors.
        part: which full HF tensors to pull (no ``target``): ``"all"`` (default; an HF
            consumer); ``"model"``, all but the MTP layers (a vLLM target model, whose
            loader skips them); ``"draft"``, the MTP layers only (a vLLM MTP draft model).
        device: where the pulled tensors land (``"cuda:0"`` in a GPU worker: NIXL reads
            trainer memory, host or GPU, straight into GPU memory; registered as VRAM).
        scratch_budget: bytes of scratch for gathered pulls (small and strided pieces read as large runs, then placed
            by one batched copy; :mod:`~megarefit.transport.gather`). ``None``: 5% of the target bytes, at least 64
            MiB (streamed: 1/8 of ``memory_budget``). Smaller budgets read in more waves through two reused halves per
            trainer rank.
        retries: pulls repeated when a rank wrote during one (its sequence or version moved), before
            StaleVersionError (``stats.retries``); a rank whose READ failed is failed over (:mod:`.failover`).
        heartbeat_s: the receiver registers under ``name`` and beats every ``heartbeat_s`` seconds on a daemon thread,
            so trainers waiting in ``Publisher.wait_receivers`` know it is alive; call :meth:`acknowledge` once the
            pulled weights are installed.
        replica_group: serve each pulled version to :class:`~megarefit.online.receiver.replica.ReplicaReceiver`
            s of this group (same target) from the arena, guarded by a seqlock of its own.
        memory_budget: bytes for a **streamed** refit (:mod:`~megarefit.online.receiver.stream`): the plan is cut into
            groups of whole layers pulled through one ring buffer (the budget less the scratch), and each group is
            handed over as it lands, so the receiver holds at most the budget (ring + scratch) instead of the whole
            share. ``"auto"``: the larger of 1 GiB and a ring holding the two largest layers. ``None`` (default):
            staged, the whole share pulled and fenced before the first tensor.
        verify_checksums: check every pulled box against the checksums its trainer rank publishes
            (``Publisher(checksums=True)``; :mod:`~megarefit.online.receiver.integrity`) on this receiver's device,
            before the box is handed over; a mismatch raises
            :class:`~megarefit.transport.checksum.ChecksumMismatchError` (streamed, after earlier groups were handed
            over: :class:`TornUpdateError`, not retried). A plan with a box no published sum covers is refused before
            anything is pulled (:class:`~megarefit.transport.checksum.UncheckableBoxError`).
        direct: streamed only: ``{target name: the consumer's tensor}`` to READ straight into (same shape and dtype,
            contiguous, on ``device``; e.g. an HF model's own parameters, or a vLLM parameter whose live bytes equal
            its checkpoint-format shard). Those targets take no ring bytes and are not handed over
            (``stats.direct_bytes``); the consumer's tensors change while the cycle runs, as a streamed install does.
            See :meth:`set_direct`.
        transport: ``"auto"`` (default): trainer ranks on this receiver's own GPU (same device UUID, exported by
            ``Publisher``) are read by device copies through CUDA IPC (:mod:`~megarefit.transport.cuda_ipc`; colocated
            RL), the rest over NIXL, in one cycle; ``"nixl"``: every rank over NIXL; ``"ipc"``: every rank through
            CUDA IPC (:class:`~megarefit.transport.cuda_ipc.IpcError` names a rank that cannot be).
        delta: staged only: where the arena holds an older version whole and the trainer ranks publish deltas
            (``Publisher(delta=True)``) of every version since, pull only the elements that changed, per tensor where
            cheaper than the tensor itself (:mod:`~megarefit.online.delta.apply`); ``stats.refit`` says which ran and
            ``stats.delta_reason`` why a cycle was full. ``False``: always full.
        reader: its place among all readers (``Reader.of(...)``): who serves each source (planner/holders.py).
        node: receivers on this host (this one included) that split the targets several need, each pulling its
            share, copying the rest from node-mates (:mod:`.node_share`, streamed: :mod:`.node_stream`; ``direct``:
            a mate's targets READ into the consumer's tensors too; ``replica_group``, staged: the arena served to
            the replicas once the mates' copies are in; ``None``: no group).
    """

    def __init__(self, rendezvous: Rendezvous, *, name: str = "megarefit-receiver", timeout: float = 60.0,
                 experts: frozenset[int] | None = None, target: VllmTarget | None = None,
                 device: torch.device | str = "cpu", scratch_budget: int | None = None, retries: int = 2,
                 heartbeat_s: float = 1.0, replica_group: str | None = None,
                 memory_budget: int | Literal["auto"] | None = None, verify_checksums: bool = False,
                 direct: Mapping[str, torch.Tensor] | None = None, transport: IpcMode = "auto",
                 part: ModelPart = "all", delta: bool = True, reader: Reader | None = None,
                 transfer_timeout: float | None = None, node: int | None = None):
        _check_options(memory_budget, replica_group, experts, target, part, direct, node)
        self.rendezvous = rendezvous
        self.part: ModelPart = part
        self.device = torch.device(device)
        self.experts = None if experts is None else frozenset(experts)
        self.replica_group = replica_group
        ipc = IpcSources(self.device, transport)  # checks the mode before any agent exists
        self.transport = NixlTransport(name, scratch_budget=scratch_budget,  # the NIXL agent: created here, once
                                       progress_thread=replica_group is not None or node is not None,  # mates READ it
                                       ipc=ipc, device=self.device)  # its GPU's nearest NIC
        self._verifier = ChecksumVerifier(self.transport, self.device) if verify_checksums else None
        BoxCopies.warm_up(self.device)  # Triton's start-up and the placement kernels, off the first refit
        self.retries, self.name = retries, name
        rendezvous.register_receiver(name)
        self._heartbeat = Heartbeat(rendezvous, name, heartbeat_s)
        # the HF planner is named here, where it always was (callers patch this module's plan_megatron_to_hf)
        self._plans = self._plan_cache(target, part, reader)
        self._memory = ReceiverMemory(self.transport, self.device, memory_budget, scratch_budget, direct)
        fence = VersionFence(rendezvous, name, self._plans.ranks_for)  # fences the ranks its plan reads
        self.node = None if node is None else NodeShare(rendezvous, name, node, timeout=timeout,
                                                         lease=3 * heartbeat_s + 2, device=self.device)
        self._pipeline = CyclePipeline(fence, self._plans, self._memory, self.transport, verifier=self._verifier,
                                       replica_group=replica_group, timeout=timeout, delta=delta,
                                       transfer_timeout=transfer_timeout, node=self.node)

        self._prefetch = PrefetchSlot(self.device, lambda: self._pipeline.stats, self.transport.polite)

    def _plan_cache(self, target: VllmTarget | None, part: ModelPart, reader: Reader | None) -> PlanCache:
        """The plans this receiver pulls by (a LoRA receiver plans adapters)."""
        return PlanCache(target, part, self.experts, hf_planner=plan_megatron_to_hf, reader=reader)

    @property
    def plan(self) -> Plan | None:
        """The plan of the last cycle (cached per layout digest), or ``None`` before the first."""
        return self._plans.plan

    @property
    def counters(self) -> dict[str, int]:
        return self._pipeline.counters

    @property
    def stats(self) -> CycleStats | None:
        """The last completed cycle's stats, or ``None`` before the first."""
        return self._pipeline.stats

    @property
    def delta_model(self) -> DeltaReceiver:
        """The delta refit's state and cost model (:class:`~megarefit.online.delta.apply.DeltaReceiver`:
        ``rates``, ``learn``, ``reason``)."""
        return self._pipeline.delta

    @property
    def plans_built(self) -> int:
        """Plans built so far (a placement seen before is not planned again)."""
        return self._plans.plans_built

    @property
    def target(self) -> VllmTarget | None:
        """The vLLM worker whose shards are pulled (:meth:`set_target` changes it), or ``None``."""
        return self._plans.target

    @property
    def memory_budget(self) -> int | Literal["auto"] | None:
        """Bytes (or ``"auto"``) of a streamed receiver; ``None``: staged."""
        return self._memory.memory_budget

    timeout = property(lambda self: self._pipeline.timeout, lambda self, s: setattr(self._pipeline, "timeout", s),
                       doc="Seconds to wait for manifests, versions and transfers (settable between cycles).")
    transfer_timeout = property(lambda self: self._pipeline.transfer_timeout, lambda self, s: setattr(
        self._pipeline, "transfer_timeout", s), doc="Seconds a pull's READs may take, or ``None`` (``timeout``).")

    @property
    def _stream(self) -> StreamRing | None:
        """Streamed: the groups and ring of the current plan (``None`` before the first cycle)."""
        return self._memory.stream

    def set_target(self, target: VllmTarget) -> bool:
        """Follow the worker's current placement before a cycle (vLLM's expert-parallel load balancer moves
        experts at run time): another target re-plans at the next cycle (cached by target: a placement seen
        before costs no planning; a prefetch of the old one is dropped); returns whether it changed.

        Raises:
            MegarefitError: this receiver pulls full HF tensors (no vLLM target to follow).
        """
        if self.target is None:
            raise MegarefitError(f"receiver {self.name!r} pulls full HF tensors: it has no vLLM target to change")
        changed = self._plans.follow(target)
        if changed:
            self._prefetch.drop()  # pulled for the old placement
        return changed

    def acknowledge(self, version: int | None = None) -> None:
        """Tell the trainers this receiver installed ``version`` (default: the last cycle's) and reads nothing
        older; ``Publisher.wait_receivers`` returns once every live receiver did (the vLLM engine calls it).

        Raises:
            MegarefitError: no cycle ran yet and no ``version`` was given.
        """
        if version is None:
            if self.stats is None:
                raise MegarefitError(f"receiver {self.name!r}: nothing to acknowledge before the first refit cycle")
            version = self.stats.version
        self.rendezvous.acknowledge(self.name, version)

    def close(self) -> None:
        """Stop the heartbeat (trainers drop it once its lease expires); drop a prefetch (:func:`_closed`)."""
        self._prefetch.drop()
        _closed(self._heartbeat, self.transport, self._memory)

    def __del__(self) -> None:
        if getattr(self, "_heartbeat", None) is not None:
            self._heartbeat.stop()

    def release_memory(self) -> int:
        """Free what the receiver holds on its device between cycles -- the arena (staged) or the ring
        (streamed), and the scratch -- e.g. while a colocated trainer trains on the same GPU and vLLM
        sleeps. Returns the bytes freed. The plan, the CUDA IPC mappings (they hold no memory of the
        receiver's) and the NIXL connections stay; the next cycle allocates and prepares again (a cold
        cycle, without planning). Tensors handed over earlier must no longer be read.

        Raises:
            MegarefitError: the receiver serves a replica or node group (they read its arena)."""
        if self.replica_group is not None or self.node is not None:
            raise MegarefitError("a receiver serving a replica or node group keeps its arena (replicas and node-mates "
                                 "READ it): release_memory() is for receivers without replica_group or node")
        self._prefetch.drop()
        freed = self._memory.release()
        self._pipeline.delta.forget("memory released")
        if self._verifier is not None:
            self._verifier.forget()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the pages back to other processes (the trainer, vLLM's KV cache)
        return freed

    @property
    def direct(self) -> frozenset[str]:
        """Names of the targets READ straight into the consumer's tensors (:meth:`set_direct`)."""
        return frozenset(self._memory.direct)

    def set_direct(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Targets to READ straight into ``tensors`` from the next cycle on (see ``direct``);
        the ring is cut again then. An empty mapping ends direct writes.

        Raises: MegarefitError: not a streamed receiver."""
        if tensors and self.memory_budget is None:
            raise MegarefitError("direct writes need a streamed refit (memory_budget=...)")
        self._memory.direct = dict(tensors)
        self._plans.invalidate()  # re-planned (same plan, cached) and the ring re-cut on the next cycle

    # ---- prefetch -------------------------------------------------------------
    def prefetch(self, version: int | None = None, prepare: Prepare | None = None) -> PrefetchState:
        """Pull ``version`` (default: the current one) into the arena on a background thread, return at once
        (:mod:`.prefetch`); the next :meth:`refit` / :meth:`run_refit_cycle` of it hands it over without pulling.
        Asked again: the running prefetch's state; another version drops it first. ``prepare``: run on the
        thread once fenced, on every ``(name, arena view)``; its result is :attr:`prepared` from the cycle that
        takes the prefetch until the next cycle or drop (``None`` for a cycle that pulled afresh).
        Raises MegarefitError for a streamed receiver (``memory_budget``): it holds no whole version."""
        if self.memory_budget is not None:
            raise refuse_streamed(self.name)
        return self._prefetch.start(version, lambda: self._pipeline.staged(version, self.retries), prepare)

    prepared = property(lambda self: self._prefetch.prepared, doc="See :meth:`prefetch` (``prepare``).")
    wait_prefetch = property(lambda self: self._prefetch.wait, doc="``wait_prefetch(timeout)``: the prefetch done.")
    prefetched = property(lambda self: self._prefetch.state(), doc="The prefetch not yet taken, or ``None``.")

    def _staged_cycle(self, version: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged cycle of ``version``: the prefetched one where it matches, else a new pull."""
        taken = self._prefetch.take(version)
        return self._pipeline.staged(version, self.retries) if taken is None else taken

    # ---- the cycle -----------------------------------------------------------
    def run_refit_cycle(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Pull ``version`` (default: the version every rank publishes) and yield HF tensors.

        Staged (``memory_budget=None``): everything is pulled and fenced before the first
        tensor is yielded, so a failure leaves the consumer's model untouched; the tensors are
        views of the arena, valid until the next cycle and never to be written (a write makes
        the next cycle a full pull, ``stats.delta_reason`` naming it; a version :meth:`prefetch`
        ed is handed over without pulling again). Streamed (``memory_budget``): each group
        of layers is yielded as it lands, as views of the ring valid only until the next
        item is requested (copy or install each before asking for the next); a rank that
        moves on during the cycle is seen after the last group (:class:`TornUpdateError`).

        Raises:
            RendezvousTimeout: a rank never published a manifest.
            VersionMismatchError / StaleVersionError: see the module docstring.
            MissingParameterError / ShapeMismatchError: a manifest lacks a tensor
                or disagrees on its shape / dtype (names tensor and rank).
            TransferError: a peer died, a READ failed or timed out (names peer, tensor, byte range),
                and no other rank holds its share (one that does is failed over: ``stats.failovers``).
            MemoryBudgetError: streamed, a layer does not fit the ring (the budget less the scratch).
            TornUpdateError: streamed, a rank moved on or wrote after tensors were handed over.
        """
        if self.memory_budget is not None:
            yield from self._pipeline.streamed(version)
            return
        yield from self._staged_cycle(version)

    def refit(self, install: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
              version: int | None = None) -> CycleStats:
        """One refit cycle consumed by ``install``, retried whole where a stream tore; its stats.

        ``install(weights)`` must consume every ``(hf_name, tensor)`` pair of the iterator
        (install or copy each before asking for the next; see :meth:`run_refit_cycle`). It is
        called once the cycle's first tensor is ready, so whatever fails before (discovery,
        versions, plan, the first pull) raises here with the consumer untouched. Streamed, a
        cycle that tears (a trainer rank wrote during it) while a new pull can succeed runs
        again into a new ``install`` call, up to ``retries`` times: a cycle writes every
        target, so the consumer then holds one version whole (``stats.retries`` counts them).

        Raises:
            TornUpdateError: streamed, still torn after ``retries`` (or the asked ``version``
                is no longer served): the consumer holds a mix of versions.
            (what :meth:`run_refit_cycle` raises before the first tensor; what ``install`` raises)
        """
        attempt = 0
        while True:
            torn: list[TornUpdateError] = []  # streamed: a torn cycle is reported once install returned
            cycle = self._pipeline.streamed(version, torn) if self.memory_budget is not None else \
                self._staged_cycle(version)
            _install_whole(cycle, install, attempt)
            if not torn:
                break
            if not torn[0].retryable or attempt >= self.retries:
                raise torn[0]
            attempt += 1
        assert self.stats is not None
        self.stats.retries += attempt
        return self.stats


def _install_whole(cycle: Iterator[tuple[str, torch.Tensor]],
                   install: Callable[[Iterator[tuple[str, torch.Tensor]]], None], attempt: int) -> None:
    """``install`` the cycle once its first tensor is ready, and check it consumed every tensor.

    Raises:
        what the cycle raises before its first tensor (the first ``attempt``); TornUpdateError
        when pulling again after a torn attempt fails (the consumer holds a mix); MegarefitError
        when ``install`` returned early."""
    try:
        first = [next(cycle)]
    except StopIteration:
        first = []
    except MegarefitError as exc:
        if attempt == 0:
            raise
        raise TornUpdateError(f"pulling again after a torn streamed cycle failed: {exc}; the consumer "
                              "holds a mix of versions: it must not serve until a refit cycle completes",
                              retryable=False) from exc
    install(itertools.chain(first, cycle))
    if next(cycle, None) is not None:
        raise MegarefitError("install returned before consuming every tensor of the cycle: the rest "
                             "was never pulled nor fenced")


__all__ = ["CycleStats", "RefitReceiver", "StaleVersionError", "TornUpdateError", "VersionMismatchError"]
