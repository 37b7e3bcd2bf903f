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
cycle (vLLM's ``load_weights`` copies them).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from megarefit.errors import LayoutError, MegarefitError, MissingParameterError, ShapeMismatchError
from megarefit.layout import RankCoord
from megarefit.online.arena import arena_key, publish_arena
from megarefit.online.integrity import ChecksumVerifier
from megarefit.online.rendezvous import Heartbeat, Rendezvous
from megarefit.online.stream import (
    ALIGN,
    SCRATCH_SHARE,
    MemoryBudgetError,
    StreamGroup,
    budget_for,
    default_memory_budget,
    stream_groups,
)
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.plan.columns import plan_threads
from megarefit.planner import plan_megatron_to_hf
from megarefit.planner.megatron_to_hf import MODEL_PARTS, ModelPart
from megarefit.quant.fp8 import Fp8Format
from megarefit.quant.kernel import Fp8Quantizer
from megarefit.quant.planning import plan_fp8
from megarefit.targets import VllmTarget, plan_megatron_to_vllm
from megarefit.transport.boxcopy import BoxCopies
from megarefit.transport.checksum import ChecksumMismatchError
from megarefit.transport.cuda_ipc import IpcMode, IpcSources
from megarefit.transport.execute import run_value_step, slots, torch_dtype
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl import DIRECT_MIN_BYTES, InFlight, NixlTransport
from megarefit.transport.nixl_agent import TransferError


class VersionMismatchError(MegarefitError):
    """Trainer ranks do not (all) publish the requested weight version."""


class StaleVersionError(VersionMismatchError):
    """A trainer rank wrote its weights (published a new version, or was inside
    ``Publisher.updating``) while its bytes were being read; ``retryable``: a new pull can
    succeed (no specific version was asked for, or the asked version is still served)."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class CycleStats:
    """One refit cycle: seconds per stage, bytes moved, and whether it was cold."""

    version: int
    cold: bool
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0  # bytes the plan places (its targets' bytes)
    model_bytes: int = 0
    wire_bytes: int = 0  # bytes the READs move (>= bytes_moved: gathered runs include the gaps between pieces)
    counters: dict[str, int] = field(default_factory=dict)
    arena_bytes: int = 0  # receiver memory holding the targets (bytes)
    scratch_bytes: int = 0  # receiver scratch for gathered pulls (bytes; bounded by ``scratch_budget``, reused)
    descriptors: int = 0  # NIXL READ descriptors per cycle (direct pulls + gathered runs)
    retries: int = 0  # pulls rejected because a rank wrote during them (seqlock), then pulled again
    install: str = "staged"  # "staged": the whole share in an arena; "streamed": groups through a ring
    peak_extra_bytes: int = 0  # receiver memory held at once for the pull: arena or ring, plus scratch (bytes)
    groups: int = 1  # groups handed over one after the other (streamed)
    checked_bytes: int = 0  # verify_checksums: bytes whose boxes were checked against the trainers' checksums
    unchecked_bytes: int = 0  # always 0: verify_checksums refuses a plan with a box no published sum covers
    checked_boxes: int = 0  # verify_checksums: boxes (plan ops) checked, every one the cycle pulled
    direct_bytes: int = 0  # streamed with ``direct``: bytes READ straight into the consumer's tensors
    ipc_bytes: int = 0  # bytes copied from trainer ranks on this GPU through CUDA IPC (part of ``wire_bytes``)
    ipc_ranks: int = 0  # trainer ranks read through CUDA IPC


class TornUpdateError(StaleVersionError):
    """A streamed cycle handed tensors over, then saw a trainer rank move past the version or
    write during the pull: the consumer holds a mix of versions and must not serve it until a
    refit cycle completes."""


@dataclass
class _Stream:
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


class _Laps:
    """Seconds per stage of a cycle: ``lap(stage)`` records the time since the previous lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._t
        self._t = now

    def restart(self) -> None:
        """Start the next stage now (time in between is not counted)."""
        self._t = time.perf_counter()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for the block (restored after): a cold cycle allocates enough
    objects to trigger full collections of a heap that torch made large (a cold-cycle profile
    on an H200 host showed 77 ms inside a trivial generator: a collection's signature)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class RefitReceiver:
    """Receives trainer weights; see the module docstring.

    Args:
        rendezvous: where trainer ranks publish manifests and versions.
        name: this receiver's NIXL agent name (unique per receiver process).
        timeout: seconds to wait for manifests, versions and transfers.
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
        scratch_budget: bytes of scratch for gathered pulls (small and strided pieces read as
            large runs, then placed by one batched copy; :mod:`~megarefit.transport.gather`).
            ``None``: 5% of the target bytes, at least 64 MiB (streamed: 1/8 of ``memory_budget``).
            Smaller budgets read in more waves through two reused halves per trainer rank.
        retries: pulls to repeat when a trainer rank wrote during one (seen through its
            update sequence or version), before StaleVersionError; counted in ``stats.retries``.
        heartbeat_s: the receiver registers under ``name`` and beats every ``heartbeat_s``
            seconds on a daemon thread, so trainers waiting in ``Publisher.wait_receivers``
            know it is alive; call :meth:`acknowledge` once the pulled weights are installed.
        replica_group: serve each pulled version to :class:`~megarefit.online.replica.ReplicaReceiver`
            s of this group (same target) from the arena, guarded by a seqlock of its own.
        memory_budget: bytes for a **streamed** refit (:mod:`~megarefit.online.stream`): the
            plan is cut into groups of whole layers pulled through one ring buffer (the budget
            less the scratch), and each group is handed over as it lands, so the receiver
            holds at most the budget (ring + scratch) instead of the whole share. ``"auto"``:
            the larger of 1 GiB and a ring holding the two largest layers. ``None``
            (default): staged, the whole share pulled and fenced before the first tensor.
        verify_checksums: check every pulled box against the checksums its trainer rank
            publishes (``Publisher(checksums=True)``; :mod:`~megarefit.online.integrity`) on
            this receiver's device, before the box is handed over; a mismatch raises
            :class:`~megarefit.transport.checksum.ChecksumMismatchError` (streamed, after
            earlier groups were handed over: :class:`TornUpdateError`, not retried). A plan
            with a box no published sum covers is refused before anything is pulled
            (:class:`~megarefit.transport.checksum.UncheckableBoxError`).
        direct: streamed only: ``{target name: the consumer's tensor}`` to READ straight into
            (same shape and dtype, contiguous, on ``device``; e.g. an HF model's own parameters,
            or a vLLM parameter whose live bytes equal its checkpoint-format shard). Those
            targets take no ring bytes and are not handed over (``stats.direct_bytes``); the
            consumer's tensors change while the cycle runs, as a streamed install does. See
            :meth:`set_direct`.
        transport: ``"auto"`` (default): trainer ranks on this receiver's own GPU (same device
            UUID, exported by ``Publisher``) are read by device copies through CUDA IPC
            (:mod:`~megarefit.transport.cuda_ipc`; colocated RL), the rest over NIXL, in one
            cycle; ``"nixl"``: every rank over NIXL; ``"ipc"``: every rank through CUDA IPC
            (:class:`~megarefit.transport.cuda_ipc.IpcError` names a rank that cannot be).
    """

    def __init__(self, rendezvous: Rendezvous, *, name: str = "megarefit-receiver", timeout: float = 60.0,
                 experts: frozenset[int] | None = None, target: VllmTarget | None = None,
                 device: torch.device | str = "cpu", scratch_budget: int | None = None, retries: int = 2,
                 heartbeat_s: float = 1.0, replica_group: str | None = None,
                 memory_budget: int | Literal["auto"] | None = None, verify_checksums: bool = False,
                 direct: Mapping[str, torch.Tensor] | None = None, transport: IpcMode = "auto",
                 part: ModelPart = "all"):
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
        self.rendezvous = rendezvous
        self.target = target
        self.part: ModelPart = part
        self.device = torch.device(device)
        self.experts = None if experts is None else frozenset(experts)
        self.replica_group = replica_group
        self.memory_budget = memory_budget
        if direct and memory_budget is None:
            raise MegarefitError("direct writes need a streamed refit (memory_budget=...): a staged refit leaves "
                                 "the consumer's tensors untouched until every byte is fenced")
        self._direct: dict[str, torch.Tensor] = dict(direct or {})
        self._scratch_given = scratch_budget
        self._stream: _Stream | None = None  # streamed: the groups and ring of the current plan
        self._serving = False  # replica_group: this arena is being rewritten (its sequence is odd)
        ipc = IpcSources(self.device, transport)  # checks the mode before any agent exists
        self.transport = NixlTransport(name, scratch_budget=scratch_budget,  # the NIXL agent: created here, once
                                       progress_thread=replica_group is not None,  # replicas READ from it
                                       ipc=ipc)
        self._verifier = ChecksumVerifier(self.transport, self.device) if verify_checksums else None
        self._verified = (0, 0)  # (checked bytes, checked boxes) of the last cycle
        BoxCopies.warm_up(self.device)  # Triton's start-up and the placement kernels, off the first refit
        self.timeout = timeout
        self.retries = retries
        self.name = name
        rendezvous.register_receiver(name)
        self._heartbeat = Heartbeat(rendezvous, name, heartbeat_s)
        self.stats: CycleStats | None = None
        self._manifests: dict[RankCoord, Manifest] = {}
        self._raw: dict[RankCoord, bytes] = {}
        self._checked: tuple[str, ...] = ()
        self._plan: Plan | None = None
        self._fmt: Fp8Format | None = None
        self._quantizer: Fp8Quantizer | None = None  # receiver-side FP8 steps, compiled per plan and buffers
        self._buffers: dict[TensorRef, torch.Tensor] = {}
        self._sizes = (0, 0)  # (model bytes handed over, arena bytes) of the current plan
        self._arenas: dict[str, torch.Tensor] = {}
        self._layout: list[tuple[str, str, int, tuple[int, ...]]] = []
        self.plans_built = 0
        self._plans: dict[tuple, Plan] = {}  # per (dims, layout, dtype, FP8 format, vLLM target): placements seen

    @property
    def plan(self) -> Plan | None:
        """The plan of the last cycle (cached per layout digest), or ``None`` before the first."""
        return self._plan

    @property
    def counters(self) -> dict[str, int]:
        return {**self.transport.counters, "plans_built": self.plans_built}

    def set_target(self, target: VllmTarget) -> bool:
        """Follow the worker's current placement before a cycle (vLLM's expert-parallel load
        balancer moves experts at run time): a target that differs from the current one
        re-plans at the next cycle (plans are cached by target, so a placement seen before
        costs no planning again); returns whether it changed.

        Raises:
            MegarefitError: this receiver pulls full HF tensors (no vLLM target to follow).
        """
        if self.target is None:
            raise MegarefitError(f"receiver {self.name!r} pulls full HF tensors: it has no vLLM target to change")
        if target == self.target:
            return False
        self.target = target
        self._plan = None  # the next cycle plans this placement (or takes its plan from self._plans)
        return True

    def acknowledge(self, version: int | None = None) -> None:
        """Tell the trainers this receiver installed ``version`` (default: the last cycle's)
        and reads nothing older; ``Publisher.wait_receivers`` returns once every live
        receiver did. The vLLM extension and engine call it after installing.

        Raises:
            MegarefitError: no cycle ran yet and no ``version`` was given.
        """
        if version is None:
            if self.stats is None:
                raise MegarefitError(f"receiver {self.name!r}: nothing to acknowledge before the first refit cycle")
            version = self.stats.version
        self.rendezvous.acknowledge(self.name, version)

    def close(self) -> None:
        """Stop the heartbeat (trainers drop this receiver once its lease expires)."""
        self._heartbeat.stop()

    def __del__(self) -> None:
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.stop()

    # ---- stages ------------------------------------------------------------
    def _discover(self) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes], tuple | None]:
        """Every rank's manifest and metadata, and their (sequences, versions) read with them
        (``None`` if not all there yet)."""
        manifests, metadata, state = self.rendezvous.manifests_and_state(self._manifests.keys() or None,
                                                                         timeout=self.timeout)
        first = manifests[min(manifests)]
        if set(manifests) != set(first.layout.ranks()):  # a new layout: rediscover every rank
            manifests, metadata, state = self.rendezvous.manifests_and_state(first.layout.ranks(),
                                                                             timeout=self.timeout)
        self._manifests = manifests
        return manifests, metadata, state

    def _wait_stable(self, ranks: list[RankCoord], first: tuple | None = None
                     ) -> tuple[dict[RankCoord, int], dict[RankCoord, int | None]]:
        """Every rank's update sequence once none is odd (no rank inside ``updating``), and the
        versions read with them (``first``: a read already made, used before reading again)."""
        deadline = time.monotonic() + self.timeout
        while True:
            seq, versions = first if first is not None else self.rendezvous.state(ranks)
            first = None
            writing = sorted(r for r, n in seq.items() if n % 2)
            if not writing:
                return seq, versions
            if time.monotonic() > deadline:
                raise StaleVersionError(f"trainer ranks still writing their weights after {self.timeout:.1f} s "
                                        f"(inside Publisher.updating, or an update that raised; {self._where()}): "
                                        + ", ".join(str(tuple(r)) for r in writing))
            time.sleep(0.001)

    def _wait_version(self, ranks: list[RankCoord], version: int | None,
                      seen: dict[RankCoord, int | None]) -> tuple[int, bool]:
        """The common version (``version`` if given; ``seen``: the versions just read) and whether
        it had to be waited for."""
        deadline = time.monotonic() + self.timeout
        waited = False
        while True:
            values = set(seen.values())
            if version is None and len(values) == 1 and None not in values:
                return values.pop(), waited  # type: ignore[return-value]
            if version is not None and values == {version}:
                return version, waited
            waited = True
            if time.monotonic() > deadline:
                detail = ", ".join(f"{tuple(r)}: {v}" for r, v in sorted(seen.items()))
                want = f"version {version}" if version is not None else "one common version"
                raise VersionMismatchError(f"trainer ranks do not publish {want} after {self.timeout:.1f} s: "
                                           f"{detail} (ranks as (tp, pp, ep): their versions; {self._where()}); "
                                           "publish it from every rank, or ask for the version they serve")
            time.sleep(0.005)
            seen = self.rendezvous.versions(ranks)

    def _plan_for(self, manifests: dict[RankCoord, Manifest]) -> tuple[Plan, bool]:
        first = manifests[min(manifests)]
        for rank, m in manifests.items():
            if m.dims != first.dims or m.layout != first.layout:
                raise LayoutError(f"rank {rank} publishes dims/layout {m.layout.to_dict()} that differ from rank "
                                  f"{first.rank}'s {first.layout.to_dict()}")
            if m.quantization != first.quantization:
                raise LayoutError(f"rank {rank} publishes quantization {m.quantization}, rank {first.rank} "
                                  f"{first.quantization}")
        dtype = first.model_dtype  # per-tensor dtypes (fp32 router bias, float8 shards) checked below
        fmt = None if first.quantization is None else Fp8Format(*first.quantization)
        plan = self._plan
        if plan is not None and (plan.dims, plan.layout, plan.dtype, self._fmt) == (first.dims, first.layout, dtype,
                                                                                   fmt):
            if not self._buffers and self._stream is None:  # release_memory() freed them: allocate again
                self._allocate(plan, manifests)
            return plan, False
        key = (first.dims, first.layout, dtype, fmt, self.target, self.part)
        cached = self._plans.get(key)  # a placement seen before (EPLB moves experts back and forth)
        if cached is not None:
            plan = cached
        elif self.target is not None:
            plan = plan_megatron_to_vllm(first.dims, first.layout, dtype, self.target, fmt)
        else:
            plan = plan_megatron_to_hf(first.dims, first.layout, dtype, self.experts, part=self.part)
            if fmt is not None:
                plan = plan_fp8(plan, fmt)
        if cached is None:
            self._plans[key] = plan
            self.plans_built += 1
        self._fmt = fmt
        self._plan = plan
        self._checked = ()
        self._allocate(plan, manifests)
        return plan, True

    def _allocate(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        """The ring (streamed) or arena (staged) of ``plan``."""
        self._quantizer = None
        if self.memory_budget is not None:
            self._stream = self._ring_for(plan)
        else:
            self._arena_for(plan, manifests)

    def release_memory(self) -> int:
        """Free what the receiver holds on its device between cycles -- the arena (staged) or the
        ring (streamed), and the scratch -- e.g. while a colocated trainer trains on the same GPU
        and vLLM sleeps. Returns the bytes freed. The plan, the CUDA IPC mappings (they hold no
        memory of the receiver's) and the NIXL connections stay; the next cycle allocates and
        prepares again (a cold cycle, without planning). Tensors handed over earlier must no
        longer be read.

        Raises:
            MegarefitError: the receiver serves a replica group (replicas read its arena)."""
        if self.replica_group is not None:
            raise MegarefitError("a receiver serving a replica group keeps its arena (replicas READ it): "
                                 "release_memory() is for receivers without replica_group")
        self._consumer_done()
        held = list(self._arenas.values()) + ([self._stream.ring] if self._stream is not None else [])
        freed = sum(t.numel() * t.element_size() for t in held)
        self.transport.release([t for t in held if self.transport.nixl.registered(t)])  # none: CUDA IPC only
        freed += self.transport.release_scratch()
        self._arenas, self._buffers, self._stream, self._quantizer = {}, {}, None, None
        if self._verifier is not None:
            self._verifier.forget()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the pages back to other processes (the trainer, vLLM's KV cache)
        return freed

    @property
    def direct(self) -> frozenset[str]:
        """Names of the targets READ straight into the consumer's tensors (:meth:`set_direct`)."""
        return frozenset(self._direct)

    def set_direct(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Targets to READ straight into ``tensors`` from the next cycle on (see ``direct``);
        the ring is cut again then. An empty mapping ends direct writes.

        Raises:
            MegarefitError: not a streamed receiver."""
        if tensors and self.memory_budget is None:
            raise MegarefitError("direct writes need a streamed refit (memory_budget=...)")
        self._direct = dict(tensors)
        self._plan = None  # re-planned (same plan, cached) and the ring re-cut on the next cycle

    def _direct_refs(self, plan: Plan) -> frozenset[TensorRef]:
        """The plan's targets written straight into the consumer's tensors, checked.

        Raises:
            MissingParameterError: a direct name is not a target this receiver hands over.
            ShapeMismatchError: a direct tensor's shape, dtype, device or layout is wrong."""
        by_name = {ref.name: ref for ref in plan.targets if ref not in plan.staging}
        refs = []
        for name, t in self._direct.items():
            ref = by_name.get(name)
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

    def _ring_for(self, plan: Plan, scratch: int | None = None) -> _Stream:
        """The groups of a streamed refit and its ring, allocated once per plan: the budget less
        ``scratch`` (default: the scratch budget). Contiguous pulls of at least a quarter of the
        scratch budget READ straight into the ring (no scratch).

        Raises:
            MemoryBudgetError: the largest layer does not fit the ring (says which budget would)."""
        self._arenas, self._buffers = {}, {}
        budget = default_memory_budget(plan) if self.memory_budget == "auto" else int(self.memory_budget)
        if self._scratch_given is None:
            self.transport.scratch_budget = budget // SCRATCH_SHARE
        self.transport.direct_min_bytes = min(DIRECT_MIN_BYTES, max(ALIGN, self.transport.scratch_budget // 4))
        scratch = self.transport.scratch_budget if scratch is None else scratch
        ring_bytes = (budget - scratch) // ALIGN * ALIGN
        direct = self._direct_refs(plan)
        salt = digest_of(sorted((r.name, self._direct[r.name].data_ptr()) for r in direct))
        try:
            groups = stream_groups(plan, ring_bytes, direct, salt)
        except MemoryBudgetError as exc:
            need = exc.ring_bytes_needed
            raise MemoryBudgetError(f"{exc}: memory_budget={budget} (a ring of {ring_bytes} bytes beside "
                                    f"{scratch} bytes of scratch) is too small; use memory_budget >= "
                                    f"{max(budget_for(need), need + scratch + ALIGN)}, 'auto', or None "
                                    "for a staged refit", need) from None
        if self._stream is not None:  # a new plan or a re-cut ring: the old ring goes
            self.transport.release([self._stream.ring])
            self._stream = None
        ring = torch.empty(max(ALIGN, *(g.start + g.nbytes for g in groups)), dtype=torch.uint8, device=self.device)
        self.transport.nixl.register([ring])  # one region: READs may span neighbouring targets
        views = [{**g.views(ring), **{r: self._direct[r.name] for r in g.plan.targets if r in direct}} for g in groups]
        return _Stream(groups, ring, views, [None] * len(groups), budget, direct)

    def _prepare_stream(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> list:
        """The groups' prepared READs, with the ring and the scratch together within the budget: a
        gathered run that cannot be split may need more scratch than its share of the budget; then
        the ring is cut again, smaller (once per plan: prepared requests are cached).

        Raises:
            MemoryBudgetError: the scratch the pulls need leaves no room for the largest layer."""
        stream = self._stream
        assert stream is not None
        for _ in range(3):
            prepared = self.transport.prepare_groups([g.plan for g in stream.groups], manifests, stream.buffers)
            scratch = self.transport.scratch_allocated
            if stream.nbytes + scratch <= stream.budget:
                return prepared
            if scratch >= stream.budget:
                break
            self._stream = stream = self._ring_for(plan, scratch)
        raise MemoryBudgetError(f"memory_budget={stream.budget}: the gathered pulls need {scratch} bytes of scratch "
                                f"beside a ring of {stream.nbytes} bytes; use a larger memory_budget, "
                                "'auto', or None for a staged refit")

    def _arena_for(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        """Allocate the arena (per dtype) holding every target, laid out in trainer order."""
        self._stream = None
        totals: dict[str, int] = {}
        for meta in plan.targets.values():
            totals[meta.dtype] = totals.get(meta.dtype, 0) + meta.numel
        arenas = {d: torch.empty(n, dtype=torch_dtype(d), device=self.device) for d, n in totals.items()}  # per dtype
        entries = {r: m.by_name() for r, m in manifests.items()}
        by_target = plan.ops_by_target

        def trainer_order(ref: TensorRef) -> tuple:
            """Where the target's first bytes live on the trainer: laying the arena out in that
            order lets neighbouring pulls travel as one descriptor (NixlTransport coalesces)."""
            ops = by_target.get(ref, ())
            if not ops or ops[0].src.name not in entries[ops[0].src.rank]:
                return (1,)
            e = entries[ops[0].src.rank][ops[0].src.name]
            return (0, tuple(ops[0].src.rank), e.region, e.addr + ops[0].src_byte_offset)

        slots, at, offsets = {}, dict.fromkeys(totals, 0), {}
        for ref in sorted(plan.targets, key=trainer_order):
            meta = plan.targets[ref]
            slots[ref] = arenas[meta.dtype][at[meta.dtype]: at[meta.dtype] + meta.numel].view(
                meta.storage_shape or meta.shape)  # as the tensor is stored (a view's storage)
            offsets[ref] = at[meta.dtype]
            at[meta.dtype] += meta.numel
        self._arenas = arenas
        self._layout = [(ref.name, plan.targets[ref].dtype, offsets[ref],
                         plan.targets[ref].storage_shape or plan.targets[ref].shape)
                        for ref in plan.targets if ref not in plan.staging]  # what replicas mirror
        self._buffers = {ref: slots[ref] for ref in plan.targets}  # handed over in plan order
        staging = plan.staging
        self._sizes = (sum(m.numel * torch_dtype(m.dtype).itemsize for r, m in plan.targets.items()
                           if r not in staging),
                       sum(a.numel() * a.element_size() for a in arenas.values()))
        for ref, meta in plan.targets.items():
            for box in meta.zero_fill:  # never pulled (vLLM vocab padding rows): zero once
                self._buffers[ref][box.slices()].zero_()

    def _check_manifests(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        key = tuple(manifests[r].memory_digest for r in sorted(manifests))
        if key == self._checked:
            return
        entries = {r: m.by_name() for r, m in manifests.items()}
        read = {op.src for op in plan.ops}
        for ref, meta in plan.sources.items():
            if ref not in read:
                continue  # e.g. experts another receiver owns
            entry = entries[ref.rank].get(ref.name)
            if entry is None:
                raise MissingParameterError(f"trainer rank {ref.rank} does not publish {ref.name} "
                                            f"(agent {manifests[ref.rank].agent!r})")
            if tuple(entry.shape) != (meta.storage_shape or meta.shape) or entry.dtype != meta.dtype:
                raise ShapeMismatchError(f"trainer rank {ref.rank} publishes {ref.name} as {entry.dtype} "
                                         f"{tuple(entry.shape)}, plan expects {meta.dtype} {meta.storage_shape or meta.shape}")
            if entry.nbytes != meta.numel * torch_dtype(meta.dtype).itemsize:
                raise ShapeMismatchError(f"trainer rank {ref.rank} publishes {entry.nbytes} bytes for {ref.name}, "
                                         f"expected {meta.numel * torch_dtype(meta.dtype).itemsize}")
        self._checked = key

    def _setup_count(self) -> tuple[int, int, int]:
        """Plans built, transfer requests and registrations so far: a cycle that changes them is cold."""
        return self.plans_built, self.transport.counters["xfers"], self.transport.counters["registrations"]

    def _fence_start(self, version: int | None, lap: Callable[[str], None]
                     ) -> tuple[dict[RankCoord, Manifest], dict[RankCoord, bytes], list[RankCoord],
                                dict[RankCoord, int], int]:
        """Discover the ranks, read their update sequences once none is writing (the seqlock,
        before the bytes) and wait for the version: ``(manifests, metadata, ranks, seq, version)``."""
        manifests, metadata, state = self._discover()
        lap("discover")
        ranks = sorted(manifests)
        seq, seen = self._wait_stable(ranks, state)  # seqlock: read before the bytes (with the generations)
        got, waited = self._wait_version(ranks, version, seen)
        if waited:  # a rank (re)started or re-registered meanwhile: its manifest may be new
            manifests, metadata, _ = self._discover()
            if sorted(manifests) != ranks:
                raise StaleVersionError("the trainer layout changed while waiting for a version", retryable=True)
        lap("version")
        return manifests, metadata, ranks, seq, got

    def _fence_end(self, ranks: list[RankCoord], seq: dict[RankCoord, int], got: int, version: int | None) -> None:
        """Re-read versions and update sequences after the bytes landed.

        Raises:
            StaleVersionError: a rank moved past ``got`` or wrote during the pull."""
        seq_after, after = self.rendezvous.state(ranks)  # seqlock: read after the bytes landed
        moved = {r: v for r, v in after.items() if v != got}
        if moved:
            raise StaleVersionError(f"ranks moved past version {got} during the pull: "
                                    + ", ".join(f"{tuple(r)} -> {v}" for r, v in sorted(moved.items())),
                                    retryable=version is None)
        rewritten = sorted(r for r in ranks if seq_after[r] != seq[r])
        if rewritten:
            raise StaleVersionError(f"ranks wrote their weights during the pull of version {got} (update sequence "
                                    "moved): " + ", ".join(f"{tuple(r)} {seq[r]} -> {seq_after[r]}" for r in rewritten),
                                    retryable=True)

    def _pull(self, version: int | None) -> tuple[Plan, object, int, dict[str, float], bool]:
        """One attempt: discover, fence, plan, pull into the arena, re-check (raises
        StaleVersionError, ``retryable`` where a new attempt can succeed)."""
        lap = _Laps()
        seconds = lap.seconds
        before = self._setup_count()
        manifests, metadata, ranks, seq, got = self._fence_start(version, lap)
        with _gc_paused(), plan_threads():  # cold: ~10^5 objects and small-array work
            plan, _ = self._plan_for(manifests)
            self._check_manifests(plan, manifests)
            if self._verifier is not None:  # every box covered by a published sum, before a byte moves
                self._verifier.require(plan, manifests)
            lap("plan")
            self.transport.connect(manifests, metadata)
            prepared = self.transport.prepare(plan, manifests, self._buffers)
            lap("prepare")
        if self.replica_group is not None and not self._serving:  # replicas must not read the arena now
            self.rendezvous.store.add(self.rendezvous.prefix + arena_key("seq", self.replica_group, self.name), 1)
            self._serving = True
        self._consumer_done()  # the previous cycle's tensors may still be read by queued device work
        with self._naming_the_job(version):
            self.transport.execute(prepared, self._buffers, timeout=self.timeout)
            if self._verifier is not None:
                self._verifier.pull(manifests, self.timeout)
        t_quant = time.perf_counter()
        if plan.quantize:  # blocks that straddle trainer shards: quantized here, after the pull (one launch on a GPU)
            if self._quantizer is None:
                step = plan.quantize[0]
                self._quantizer = Fp8Quantizer([item for q in plan.quantize for item in slots(
                    self._buffers[q.staging], self._buffers[q.weight], self._buffers[q.scale])],
                                               Fp8Format(step.block, step.ue8m0))
            self._quantizer()
        for t in plan.transforms:  # value steps (vLLM's Mamba A = -exp(A_log)), after the pull
            run_value_step(t, self._buffers[t.staging], self._buffers[t.target])
        if plan.quantize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        quant_s = time.perf_counter() - t_quant
        lap("pull")
        seconds.update({f"pull.{k}": v for k, v in self.transport.last_seconds.items()})
        if plan.quantize:
            seconds["pull.quantize"] = quant_s
        self._fence_end(ranks, seq, got, version)
        lap("fence")
        if self._verifier is not None:  # after the fence: a mismatch is not a concurrent write
            self._verified = self._verifier.verify(plan, self._buffers, manifests, got)
            lap("verify")
        cold = before != self._setup_count()
        return plan, prepared, got, seconds, cold

    def _where(self) -> str:
        """This receiver's job and rendezvous, for error messages."""
        store = self.rendezvous.store
        return f"receiver {self.name!r}, job {self.rendezvous.job!r}, rendezvous {store.host}:{store.port}"

    @contextlib.contextmanager
    def _naming_the_job(self, version: int | None, streamed: bool = False) -> Iterator[None]:
        """A failed transfer names this receiver's job, rendezvous and version, and what to do."""
        try:
            yield
        except TransferError as exc:
            raise TransferError(
                f"{self._where()}, pulling version {'latest' if version is None else version}: {exc}. The trainer rank named may "
                "have died or re-registered its memory: check that process, restart it if needed, then refit "
                "again; " + ("groups handed over before it may hold this version: the consumer must not serve until a "
                             "refit completes" if streamed else "nothing pulled in this attempt was handed over")
            ) from exc

    # ---- the cycle -----------------------------------------------------------
    def run_refit_cycle(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Pull ``version`` (default: the version every rank publishes) and yield HF tensors.

        Staged (``memory_budget=None``): everything is pulled and fenced before the first
        tensor is yielded, so a failure leaves the consumer's model untouched; the tensors are
        views of the arena, valid until the next cycle. Streamed (``memory_budget``): each group
        of layers is yielded as it lands, as views of the ring valid only until the next
        item is requested (copy or install each before asking for the next); a rank that
        moves on during the cycle is seen after the last group (:class:`TornUpdateError`).

        Raises:
            RendezvousTimeout: a rank never published a manifest.
            VersionMismatchError / StaleVersionError: see the module docstring.
            MissingParameterError / ShapeMismatchError: a manifest lacks a tensor
                or disagrees on its shape / dtype (names tensor and rank).
            TransferError: a peer died, a READ failed or timed out (names peer,
                tensor, byte range).
            MemoryBudgetError: streamed, a layer does not fit the ring (the budget less the scratch).
            TornUpdateError: streamed, a rank moved on or wrote after tensors were handed over.
        """
        if self.memory_budget is not None:
            yield from self._run_streamed(version)
            return
        retries = 0
        while True:
            try:
                plan, prepared, got, seconds, cold = self._pull(version)
                break
            except StaleVersionError as exc:
                if not exc.retryable or retries >= self.retries:
                    raise
                retries += 1
        if self.replica_group is not None:  # the arena holds version `got` whole: serve it
            publish_arena(self.rendezvous, self.replica_group, self.name, self._arenas, self._layout, got,
                          self.transport.nixl.metadata)
            self.rendezvous.store.add(self.rendezvous.prefix + arena_key("seq", self.replica_group, self.name), 1)
            self._serving = False
        model_bytes, arena_bytes = self._sizes
        self.stats = CycleStats(got, cold, seconds, plan.nbytes, model_bytes, prepared.wire_bytes, dict(self.counters),
                                arena_bytes, prepared.scratch_bytes, prepared.descriptors, retries,
                                peak_extra_bytes=arena_bytes + prepared.scratch_bytes, checked_bytes=self._verified[0],
                                checked_boxes=self._verified[1], ipc_bytes=prepared.ipc_bytes,
                                ipc_ranks=len(self.transport.ipc.ranks))
        staging = plan.staging
        for ref, tensor in self._buffers.items():
            if ref not in staging:
                yield ref.name, tensor

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
            cycle = self._run_streamed(version, torn) if self.memory_budget is not None else \
                self.run_refit_cycle(version)
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
            if not torn:
                break
            if not torn[0].retryable or attempt >= self.retries:
                raise torn[0]
            attempt += 1
        assert self.stats is not None
        self.stats.retries += attempt
        return self.stats

    # ---- streamed cycles -----------------------------------------------------
    def _consumer_done(self) -> None:
        """Wait for the device work the consumer queued on tensors handed over earlier (vLLM's
        copies into its parameters run asynchronously on a GPU), before NIXL overwrites them:
        a READ is not ordered with any CUDA stream. A no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _finish_group(self, k: int) -> None:
        """After group ``k`` landed: zero its never-pulled boxes (the ring held another group),
        run its receiver-side FP8 steps, and wait for them on a GPU."""
        stream = self._stream
        assert stream is not None
        group, bufs = stream.groups[k], stream.buffers[k]
        for ref, meta in group.plan.targets.items():
            for box in meta.zero_fill:
                bufs[ref][box.slices()].zero_()
        for t in group.plan.transforms:
            run_value_step(t, bufs[t.staging], bufs[t.target])
        if not group.plan.quantize:
            return
        if stream.quantizers[k] is None:
            step = group.plan.quantize[0]
            stream.quantizers[k] = Fp8Quantizer([item for q in group.plan.quantize for item in slots(
                bufs[q.staging], bufs[q.weight], bufs[q.scale])], Fp8Format(step.block, step.ue8m0))
        stream.quantizers[k]()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _land(self, k: int, flight: InFlight | None, prepared: list) -> None:
        """Group ``k`` in the ring, finished: its READs (posted by ``flight``, else now) waited
        for, its zero fills and FP8 steps run."""
        if flight is None:
            self._consumer_done()  # the ring bytes handed over before may still be read by queued copies
            flight = self.transport.start(prepared[k])
        self.transport.wait(flight, timeout=self.timeout)
        self._finish_group(k)

    def _check_group(self, manifests: dict[RankCoord, Manifest], fence: tuple, k: int) -> bool:
        """Verify streamed group ``k`` against the checksums; ``False`` (stop checking: the
        end fence reports the cycle torn) when a mismatch comes from a rank that wrote.

        Raises:
            ChecksumMismatchError: group 0 differs (nothing handed over yet).
            TornUpdateError: a later group differs, and no rank wrote (not retried)."""
        stream = self._stream
        assert stream is not None and self._verifier is not None
        try:
            checked, boxes = self._verifier.verify(stream.groups[k].plan, stream.buffers[k], manifests, fence[2])
        except ChecksumMismatchError as exc:
            try:
                self._fence_end(*fence)
            except StaleVersionError:
                return False
            if k == 0:
                raise
            raise TornUpdateError(f"{exc}; {k} earlier group(s) were already handed over, so the consumer holds a mix of "
                                  "versions: it must not serve until a refit cycle completes", retryable=False) from exc
        self._verified = (self._verified[0] + checked, self._verified[1] + boxes)
        return True

    def _stream_groups(self, stream: _Stream, prepared: list, check: Callable[[int], bool] | None = None
                       ) -> Generator[tuple[str, torch.Tensor], None, float]:
        """Hand over each group's tensors in turn; group ``k + 1``'s READs are posted before
        group ``k`` is handed over when their ring bytes differ (they move while the consumer
        installs group ``k``), else after. Returns the seconds spent pulling (waiting for
        READs, placing, FP8 steps), not installing."""
        pull_s, flight = 0.0, None
        groups = stream.groups
        try:
            for k, (group, bufs) in enumerate(zip(groups, stream.buffers)):
                t_pull = time.perf_counter()
                self._land(k, flight, prepared)
                flight = None
                if check is not None and not check(k):
                    check = None
                if k + 1 < len(groups) and not groups[k + 1].overlaps(group):
                    self._consumer_done()  # group k + 1 lands where group k - 1 was: its copies must be done
                    flight = self.transport.start(prepared[k + 1])
                pull_s += time.perf_counter() - t_pull
                for ref, tensor in bufs.items():
                    if ref not in group.plan.staging and ref not in stream.direct:
                        yield ref.name, tensor  # valid until the next item is requested
        finally:
            if flight is not None and not flight.done:  # the consumer stopped early: let the READs land
                with contextlib.suppress(MegarefitError):
                    self.transport.wait(flight, timeout=self.timeout)
        return pull_s

    def _run_streamed(self, version: int | None, torn: list[TornUpdateError] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """A streamed cycle (``memory_budget``): each group is pulled into the ring and its
        tensors handed over before the next group is pulled; the versions and update sequences
        are checked again after the last group. ``torn``: a torn cycle is appended there and
        the iterator ends normally (the consumer finishes its install, e.g. vLLM's reload)
        instead of raising.

        Raises:
            TornUpdateError: a rank moved on or wrote during the cycle, after tensors were handed over.
            (and what :meth:`run_refit_cycle` raises before the first tensor)"""
        lap = _Laps()
        seconds = lap.seconds
        before = self._setup_count()
        manifests, metadata, ranks, seq, got = self._fence_start(version, lap)
        with _gc_paused(), plan_threads():
            plan, _ = self._plan_for(manifests)
            self._check_manifests(plan, manifests)
            if self._verifier is not None:  # every box covered by a published sum, before a byte moves
                self._verifier.require(plan, manifests)
            lap("plan")
            self.transport.connect(manifests, metadata)
            prepared = self._prepare_stream(plan, manifests)
            stream = self._stream
            assert stream is not None
            lap("prepare")
        cold = before != self._setup_count()
        self._verified = (0, 0)
        check = None
        if self._verifier is not None:
            self._verifier.pull(manifests, self.timeout)
            check = functools.partial(self._check_group, manifests, (ranks, seq, got, version))
        with self._naming_the_job(version, streamed=True):
            pull_s = yield from self._stream_groups(stream, prepared, check)
        seconds["pull"] = pull_s
        lap.restart()
        try:
            self._fence_end(ranks, seq, got, version)
        except StaleVersionError as exc:
            error = TornUpdateError(f"{exc}; {len(stream.groups)} groups were already handed over, so the consumer "
                                    "holds a mix of versions: it must not serve until a refit cycle completes",
                                    retryable=exc.retryable)
            if torn is None:
                raise error from exc
            error.__cause__ = exc
            torn.append(error)
            return
        lap("fence")
        scratch = self.transport.scratch_allocated
        model_bytes = sum(m.numel * torch_dtype(m.dtype).itemsize for r, m in plan.targets.items()
                          if r not in plan.staging)
        self.stats = CycleStats(got, cold, seconds, plan.nbytes, model_bytes, sum(p.wire_bytes for p in prepared),
                                dict(self.counters), 0, scratch, sum(p.descriptors for p in prepared), 0,
                                install="streamed", peak_extra_bytes=stream.nbytes + scratch,
                                groups=len(stream.groups), checked_bytes=self._verified[0],
                                checked_boxes=self._verified[1],
                                direct_bytes=sum(self._direct[r.name].numel() * self._direct[r.name].element_size()
                                                 for r in stream.direct),
                                ipc_bytes=sum(p.ipc_bytes for p in prepared), ipc_ranks=len(self.transport.ipc.ranks))
