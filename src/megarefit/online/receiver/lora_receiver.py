"""LoraReceiver: an adapter-only refit cycle, trainer LoRA shards -> HF PEFT tensors and ``peft_config``.

A :class:`LoraReceiver` is a :class:`~megarefit.online.receiver.receiver.RefitReceiver` on an adapter's
channel (:meth:`Rendezvous.channel`, served by :class:`~megarefit.online.trainer.lora_publisher.
LoraPublisher` s). Its plans are :func:`~megarefit.planner.lora_to_peft.plan_lora_to_peft`'s, from the
adapter rows, ``r`` and layout the manifests publish, so every check of a full refit holds for the
adapter too: discovery, the version fence and seqlock (a pull that overlapped ``updating`` is pulled
again), checksums (``verify_checksums``), heartbeats and :meth:`acknowledge`::

    cycle        manifests -> LoraInfo checked (an adapter channel; the base version this engine holds)
                 -> plan (cached per layout, r, rows) -> pull -> fence -> PEFT tensors
    adapter      pull_adapter(): the tensors copied out, with peft_config {r, lora_alpha, target_modules}

The base check: ``base_version`` is the version of the base weights this engine holds (a full refit's,
or -1 for the checkpoint it loaded). An adapter trained on another base is refused before a byte moves
(:class:`~megarefit.errors.BaseChangedError`): refit the base first, then set :attr:`base_version`.
Staged only (no ``memory_budget``, ``node``, ``replica_group``, delta or vLLM-sharded target: vLLM's
LoRA layers take the full factors and slice them for their TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import BaseChangedError, MegarefitError
from megarefit.layout import RankCoord
from megarefit.online.receiver.plan_cache import PlanCache, common_manifest
from megarefit.online.receiver.receiver import RefitReceiver
from megarefit.plan import Plan
from megarefit.planner.holders import read_ranks
from megarefit.planner.lora_to_peft import adapter_rows, peft_config, plan_lora_to_peft
from megarefit.transport.manifest import LoraInfo, Manifest


@dataclass(frozen=True)
class PulledAdapter:
    """One adapter version as PEFT holds it.

    Attributes:
        tensors: ``{PEFT name: tensor}`` (``base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight``
            ``[r, in_features]``, ``lora_B`` ``[out_features, r]``), the receiver's copies.
        peft_config: PEFT ``LoraConfig`` essentials: ``peft_type``, ``r``, ``lora_alpha``, ``target_modules``.
        version: the trainer version pulled; ``base_version``: the base it trains on.
    """

    tensors: dict[str, torch.Tensor]
    peft_config: dict[str, Any]
    version: int
    base_version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class LoraPlanCache(PlanCache):
    """A :class:`PlanCache` of adapter plans (one per dims, layout, dtype, ``r`` and adapter rows),
    checking each cycle's :class:`LoraInfo` first."""

    def __init__(self, base_version: int = -1):
        super().__init__(None)
        self.base_version = base_version
        self.info: LoraInfo | None = None

    def _key(self, first: Manifest) -> tuple:
        return first.layout_digest, tuple(e.name for e in first.tensors)

    def _check_one(self, first: Manifest) -> LoraInfo:
        """``first``'s LoRA record, on the base this engine holds.

        Raises:
            MegarefitError: ``first`` publishes model weights (no LoRA record).
            BaseChangedError: the adapter trains on another base version."""
        info = first.lora
        if info is None:
            raise MegarefitError(f"trainer rank {first.rank} publishes model weights on this channel, not a LoRA "
                                 "adapter: give the LoraReceiver the adapter's Rendezvous.channel(...)")
        if info.base_version != self.base_version:
            raise BaseChangedError(f"the adapter trains on base version {info.base_version}, this engine holds base "
                                   f"version {self.base_version}: refit the base first (a full refit cycle), then set "
                                   "LoraReceiver.base_version to that version")
        return info

    def _check_info(self, manifests: dict[RankCoord, Manifest]) -> Manifest:
        first = common_manifest(manifests)
        info = self._check_one(first)
        others = {r: m.lora for r, m in manifests.items() if m.lora != info}
        if others:
            raise MegarefitError(f"trainer ranks disagree on the adapter: {first.rank} {info}, others {others}")
        return first

    def plan_for(self, manifests: dict[RankCoord, Manifest]) -> tuple[Plan, bool]:
        first = self._check_info(manifests)
        plan = self._planned(first)
        new = plan is not self._plan
        self._plan, self.info = plan, first.lora
        if new:
            self._checked = ()
        return plan, new

    def _planned(self, first: Manifest) -> Plan:
        key = self._key(first)
        plan = self._plans.get(key)
        if plan is None:
            assert first.lora is not None
            rows = adapter_rows([e.name for e in first.tensors])
            plan = plan_lora_to_peft(first.dims, first.layout, first.model_dtype, first.lora.r, rows)
            self._plans[key], self._ranks[key] = plan, read_ranks(plan)
            self.plans_built += 1
        return plan

    def ranks_for(self, first: Manifest) -> list[RankCoord]:
        self._check_one(first)  # before anything is planned
        self._planned(first)
        return self._ranks[self._key(first)]

    @property
    def base(self) -> Plan:
        if self._plan is None:
            raise MegarefitError("no current plan: plan_for() first")
        return self._plan


class LoraReceiver(RefitReceiver):
    """Pulls one LoRA adapter's versions; see the module docstring.

    Args:
        rendezvous: the adapter's channel (``Rendezvous.channel("lora/<name>")``).
        base_version: the base version this engine holds (-1: the checkpoint it loaded).
        name, timeout, device, retries, heartbeat_s, verify_checksums, transport, transfer_timeout: as
            :class:`RefitReceiver`.

    Raises:
        MegarefitError: an option an adapter refit does not take (``memory_budget``, ``node``, ``replica_group``,
            ``target``, ``experts``, ``direct``, ``delta``).
    """

    def __init__(self, rendezvous: Any, *, base_version: int = -1, **options: Any):
        for refused in ("memory_budget", "node", "replica_group", "target", "experts", "direct", "part", "reader"):
            if options.get(refused) is not None:
                raise MegarefitError(f"LoraReceiver takes no {refused}= (an adapter is pulled whole and staged)")
        if options.pop("delta", False):
            raise MegarefitError("LoraReceiver takes no delta= (an adapter is pulled whole: it is small)")
        self._base_version = base_version
        super().__init__(rendezvous, delta=False, **options)

    def _plan_cache(self, target: Any, part: Any, reader: Any) -> PlanCache:
        return LoraPlanCache(self._base_version)

    @property
    def base_version(self) -> int:
        """The base version this engine holds; set it after a full refit of the base."""
        return self._plans.base_version  # type: ignore[attr-defined]

    @base_version.setter
    def base_version(self, version: int) -> None:
        self._plans.base_version = int(version)  # type: ignore[attr-defined]

    def pull_adapter(self, version: int | None = None) -> PulledAdapter:
        """One refit cycle of the adapter (``version``, default the one every rank publishes), copied out.

        Raises:
            BaseChangedError: the adapter trains on another base than :attr:`base_version`.
            and what :meth:`RefitReceiver.run_refit_cycle` raises (nothing is returned then).
        """
        tensors = {name: t.clone() for name, t in self.run_refit_cycle(version)}
        info = self._plans.info  # type: ignore[attr-defined]
        assert info is not None and self.stats is not None
        return PulledAdapter(tensors, peft_config(tensors, info.r, info.alpha), self.stats.version, info.base_version)


__all__ = ["LoraPlanCache", "LoraReceiver", "PulledAdapter"]
