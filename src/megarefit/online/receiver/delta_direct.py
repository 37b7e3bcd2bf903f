"""Delta refits of a streamed receiver's direct targets: patch the consumer's own tensors.

A streamed receiver (``memory_budget``) keeps no arena between cycles, but its ``direct``
targets are the consumer's tensors (e.g. vLLM parameters the direct-write evidence rule allows:
nothing post-processes them), and after a whole cycle they hold its version byte for byte. So a
later cycle can patch them with the elements changed since, and stream only the other targets::

    choose    the direct targets' sub-plan: the delta receiver's choice (cost model, chains of
              records from the version they hold), or why not (stats.delta_reason)
    pull      the delta's byte ranges land in the ring (free before the first group), the fence
              is checked (a rank that wrote: nothing is written, the cycle streams in full),
              then the changed elements are scattered into the direct tensors
    stream    each group through the ring as before, its direct targets left out (their own
              prepared READs); the checksums of a group cover its patched direct targets too
    hold      after a cycle fenced whole (not torn), the direct tensors hold its version

Never patched: direct tensors replaced by :meth:`~megarefit.online.receiver.receiver.RefitReceiver.set_direct`
or written by anyone else between cycles (the receiver cannot see that: call ``set_direct``
again, which forgets the version held), and a cycle that tore (the next one is full).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from megarefit.online.delta.apply import DeltaChoice, DeltaReceiver
from megarefit.online.receiver.fence import FenceStart, VersionFence
from megarefit.online.receiver.memory import StreamRing
from megarefit.online.receiver.stream import sub_plan
from megarefit.plan import Plan, TensorRef
from megarefit.plan.ops import digest_of
from megarefit.transport.nixl import NixlTransport


class DirectDelta:
    """The direct-target deltas of one streamed receiver (see the module docstring)."""

    def __init__(self, delta: DeltaReceiver, transport: NixlTransport):
        self.delta, self.transport = delta, transport
        # (key, direct sub-plan, rest plans, the direct tensors by target): once per plan and ring
        self._plans: tuple[tuple, Plan | None, list[Plan], dict[TensorRef, torch.Tensor]] | None = None
        self.choice: DeltaChoice | None = None  # the last cycle's patch, if it was one

    def plans(self, plan: Plan, stream: StreamRing) -> tuple[Plan | None, list[Plan]]:
        """The direct targets' sub-plan (None: no direct target) and each group's plan without
        them; built once per plan and ring (the ring is cut again when the direct tensors change)."""
        key = (plan.digest, tuple(g.plan.digest for g in stream.groups))
        if self._plans is None or self._plans[0] != key:
            direct = [r for r in plan.targets if r in stream.direct]
            rest = [sub_plan(g.plan, [r for r in g.plan.targets if r not in stream.direct],
                             digest_of(g.plan.digest, "rest")) for g in stream.groups]
            views = {r: t for g in stream.buffers for r, t in g.items() if r in stream.direct}
            self._plans = (key, sub_plan(plan, direct, digest_of(plan.digest, "direct", sorted(r.name for r in direct)))
                           if direct else None, rest, views)
        return self._plans[1], self._plans[2]

    def patch(self, fence: VersionFence, plan: Plan, stream: StreamRing, start: FenceStart, timeout: float) -> bool:
        """Patch the direct tensors with the delta from the version they hold, if the cost model
        chooses it; whether it did (then stream :meth:`rest_prepared`). Nothing is written when it
        did not (``delta.reason`` says why). Call once the consumer is done with the ring (the
        ranges land in it).

        Raises:
            TransferError: a delta READ failed (nothing written).
            StaleVersionError: a rank wrote during the delta read (nothing written; ``retryable``)."""
        self.choice = None
        direct_plan, _ = self.plans(plan, stream)
        if direct_plan is None:
            self.delta.forget("a streamed receiver keeps no version between cycles, and none of its targets is direct")
            return False
        choice = self.delta.choice(fence.rendezvous, direct_plan, start.manifests, start.ranks, start.version)
        if isinstance(choice, str):
            self.delta.reason = choice
            return False
        if choice.nbytes > stream.ring.numel():
            self.delta.reason = f"the delta ({choice.nbytes} bytes) does not fit the ring ({stream.ring.numel()} bytes)"
            return False
        assert self._plans is not None
        self.delta.pull(direct_plan, choice, self._plans[3], start.manifests, timeout,
                        stable=functools.partial(fence.end, start), landing=stream.ring)
        self.choice = choice
        return True

    def rest_prepared(self, plan: Plan, stream: StreamRing, manifests: Mapping) -> list:
        """The groups' prepared READs without their direct targets (prepared once per plan and
        ring; preparing the full groups again releases them)."""
        return self.transport.prepare_groups(self.plans(plan, stream)[1], manifests, stream.buffers)

    def stats(self, plan: Plan, stream: StreamRing, direct_bytes: int) -> tuple[int, dict]:
        """The cycle's bytes placed (a patch: its bytes read plus the streamed targets') and its
        :class:`~megarefit.online.receiver.cycle.CycleStats` delta fields, with ``"read"``: the patch's bytes
        read (0 for a full cycle)."""
        patch = self.choice
        if patch is None:
            return plan.nbytes, {"delta_reason": self.delta.reason, "read": 0}
        streamed = sum(g.plan.nbytes for g in stream.groups) - direct_bytes
        return patch.nbytes + streamed, {"refit": "delta", "delta_base": patch.base, "delta_tensors": len(patch.delta),
                                         "full_tensors": len(patch.full), "changed_elements": patch.changed,
                                         "read": patch.nbytes}

    def hold(self, plan: Plan, stream: StreamRing, start: FenceStart, pull_s: float, wire_bytes: int,
             cold: bool) -> None:
        """After a cycle fenced whole: the direct tensors hold its version; a warm full cycle
        teaches the cost model the read rate and what reading the direct targets whole costs."""
        direct_plan, _ = self.plans(plan, stream)
        if direct_plan is None:
            return
        if self.choice is None and not cold:
            self.delta.measured("wire", wire_bytes, pull_s)
            self.delta.measured("full", 0, direct_plan.nbytes / self.delta.rates["wire"])
        self.delta.hold(start.version, direct_plan, start.manifests)


__all__ = ["DirectDelta"]
