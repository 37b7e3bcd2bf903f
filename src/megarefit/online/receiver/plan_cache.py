"""A receiver's plans: one per trainer layout and placement, built once, checked against manifests.

Planning reads only shapes (the manifests' dims, layout, dtype and FP8 format) and what the
receiver pulls (a vLLM worker's :class:`~megarefit.targets.VllmTarget`, or full HF tensors:
``part`` and ``experts``); it never touches memory or the wire::

    key = (dims, layout, dtype, FP8 format, target, part)   (then each source read from one of its
                                                              holders: planner/holders.py)
    same as the current plan's           -> the current plan               (not new)
    seen before (EPLB moved experts back) -> that plan, no planning again  (new)
    else                                  -> planned, cached               (new, plans_built + 1)

Each cycle's manifests are checked against the plan (every tensor the plan reads is
published with its shape, dtype and bytes), again only when their memory digests change.
"""

from __future__ import annotations

from collections.abc import Callable

from megarefit.errors import LayoutError, MegarefitError, MissingParameterError, ShapeMismatchError
from megarefit.layout import RankCoord
from megarefit.plan import Plan
from megarefit.plan.table import OpTable
from megarefit.planner import plan_megatron_to_hf
from megarefit.planner.holders import Reader, assign_holders, read_ranks, replacements
from megarefit.planner.megatron_to_hf import ModelPart
from megarefit.quant.fp8 import Fp8Format
from megarefit.quant.planning import plan_fp8
from megarefit.targets import VllmTarget, plan_megatron_to_vllm
from megarefit.transport.execute import torch_dtype
from megarefit.transport.manifest import Manifest


def common_manifest(manifests: dict[RankCoord, Manifest]) -> Manifest:
    """The first rank's manifest, once every rank agrees with it on dims, layout and quantization.

    Raises:
        LayoutError: a rank disagrees (names both ranks and the values)."""
    first = manifests[min(manifests)]
    for rank, m in manifests.items():
        if m.dims != first.dims or m.layout != first.layout:
            raise LayoutError(f"rank {rank} publishes dims/layout {m.layout.to_dict()} that differ from rank "
                              f"{first.rank}'s {first.layout.to_dict()}")
        if m.quantization != first.quantization:
            raise LayoutError(f"rank {rank} publishes quantization {m.quantization}, rank {first.rank} "
                              f"{first.quantization}")
    return first


class PlanCache:
    """The plans of one receiver (see the module docstring).

    Args:
        target: the vLLM worker whose shards are pulled, or ``None`` (full HF tensors).
        part: which full HF tensors (``"all"``, ``"model"``, ``"draft"``; ``"all"`` with a target).
        experts: the global routed experts pulled (full HF tensors only); ``None``: all.
        hf_planner: plans full HF tensors (``plan_megatron_to_hf``'s signature).
        reader: which holder of each source tensor this receiver reads from
            (:func:`~megarefit.planner.holders.assign_holders`); ``None``: with a target, worker
            ``tp_rank + tp * dp_rank`` of its engine, else the only reader.
    """

    def __init__(self, target: VllmTarget | None, part: ModelPart = "all", experts: frozenset[int] | None = None,
                 hf_planner: Callable[..., Plan] = plan_megatron_to_hf, reader: Reader | None = None):
        self.reader = reader
        self.target = target
        self.part: ModelPart = part
        self.experts = experts
        self.plans_built = 0
        self._hf_planner = hf_planner
        self._plan: Plan | None = None
        self._fmt: Fp8Format | None = None
        self._plans: dict[tuple, Plan] = {}  # per (dims, layout, dtype, FP8 format, vLLM target): placements seen
        self._ranks: dict[tuple, list[RankCoord]] = {}  # per key: the ranks its plan reads
        self._base: dict[tuple, Plan] = {}  # per key less the exclusions: the plan before holders were chosen
        self.excluded: frozenset[RankCoord] = frozenset()  # ranks whose READs failed: read from other holders
        self._checked: tuple[str, ...] = ()  # the memory digests the current plan was checked against

    @property
    def plan(self) -> Plan | None:
        """The current plan (the last cycle's), or ``None`` before the first or after :meth:`invalidate`."""
        return self._plan

    @property
    def base(self) -> Plan:
        """The current plan before holders were chosen (every source at its coordinate's first holder).

        Raises:
            MegarefitError: no current plan."""
        plan = self._plan
        if plan is None:
            raise MegarefitError("no current plan: plan_for() first")
        return self._base[(plan.dims, plan.layout, plan.dtype, self._fmt, self.target, self.part)]

    def invalidate(self) -> None:
        """The next :meth:`plan_for` returns its plan as new (from the cache if seen before)."""
        self._plan = None

    def follow(self, target: VllmTarget) -> bool:
        """Plan for ``target`` from the next cycle on; returns whether it changed.

        Raises:
            MegarefitError: this cache plans full HF tensors (no vLLM target to follow)."""
        if self.target is None:
            raise MegarefitError("this receiver pulls full HF tensors: it has no vLLM target to change")
        if target == self.target:
            return False
        self.target = target
        self._plan = None  # the next cycle plans this placement (or takes its plan from self._plans)
        return True

    def plan_for(self, manifests: dict[RankCoord, Manifest]) -> tuple[Plan, bool]:
        """The plan for the layout the ranks publish, and whether it is new (not the current plan).

        Raises:
            LayoutError: the ranks disagree on dims, layout or quantization."""
        first = common_manifest(manifests)
        fmt = None if first.quantization is None else Fp8Format(*first.quantization)
        plan = self._plan
        if plan is not None and (plan.dims, plan.layout, plan.dtype, self._fmt) == (first.dims, first.layout,
                                                                                   first.model_dtype, fmt):
            return plan, False
        plan = self._planned(first)
        self._fmt = fmt
        self._plan = plan
        self._checked = ()
        return plan, True

    def _planned(self, first: Manifest) -> Plan:
        """The plan for ``first``'s dims, layout, dtype and FP8 format, holders chosen: from the
        cache, else planned and cached (``plans_built`` + 1)."""
        dtype = first.model_dtype  # per-tensor dtypes (fp32 router bias, float8 shards) checked by check_manifests
        fmt = None if first.quantization is None else Fp8Format(*first.quantization)
        key = (first.dims, first.layout, dtype, fmt, self.target, self.part, self.excluded)
        plan = self._plans.get(key)  # a placement seen before (EPLB moves experts back and forth)
        if plan is not None:
            return plan
        base = self._base.get(key[:-1])
        if base is None:
            if self.target is not None:
                base = plan_megatron_to_vllm(first.dims, first.layout, dtype, self.target, fmt)
            else:
                base = self._hf_planner(first.dims, first.layout, dtype, self.experts, part=self.part)
                if fmt is not None:
                    base = plan_fp8(base, fmt)
            self._base[key[:-1]] = base
        plan = base
        if isinstance(plan.ops, OpTable) or plan.layout.copies > 1:  # (op-by-op plans: one copy, as planned)
            plan = assign_holders(plan, self._reader(), self.excluded)
        self._plans[key] = plan
        self._ranks[key] = read_ranks(plan)
        self.plans_built += 1
        return plan

    def _reader(self) -> Reader:
        if self.reader is not None:
            return self.reader
        t = self.target
        return Reader() if t is None else Reader.of(0, 1, t.rank + t.tp * t.dp_rank, t.tp * t.dp)

    def ranks_for(self, first: Manifest) -> list[RankCoord]:
        """The trainer ranks the plan for ``first``'s layout reads (holders chosen): the ranks a
        fence reads. Plans and caches that plan; the current plan stays as it is."""
        self._planned(first)
        fmt = None if first.quantization is None else Fp8Format(*first.quantization)
        return self._ranks[(first.dims, first.layout, first.model_dtype, fmt, self.target, self.part, self.excluded)]

    def fail_over(self, rank: RankCoord) -> list[RankCoord]:
        """Read from other holders what ``rank`` served (its READ failed): the next plan excludes
        it. Returns the ranks that serve its share instead.

        Raises:
            NoHolderError: some tensor ``rank`` served has no other holder.
            MegarefitError: there is no current plan, or it is not columnar."""
        plan = self._plan
        if plan is None or not isinstance(plan.ops, OpTable):
            raise MegarefitError(f"rank {rank} failed, and this receiver has no plan with holders to fail over in")
        base = self._base[(plan.dims, plan.layout, plan.dtype, self._fmt, self.target, self.part)]
        replaced = replacements(base, self._reader(), self.excluded, rank)
        self.excluded = self.excluded | {rank}
        self._plan = None
        return replaced

    def readmit(self, rank: RankCoord) -> None:
        """Read from ``rank`` again (it re-registered after it failed)."""
        self.excluded = self.excluded - {rank}
        self._plan = None

    def check_manifests(self, plan: Plan, manifests: dict[RankCoord, Manifest]) -> None:
        """Every source tensor ``plan`` reads is published with its shape, dtype and bytes
        (checked again only when a rank's memory digest changes).

        Raises:
            MissingParameterError: a rank does not publish a tensor the plan reads (names both).
            ShapeMismatchError: a rank publishes it with another shape, dtype or byte count."""
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


__all__ = ["PlanCache", "common_manifest"]
