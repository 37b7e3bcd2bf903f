"""One streamed cycle's groups: landed in the ring in turn, checked, handed over; a trainer rank
whose READ fails mid-stream is failed over, as in a staged cycle (:mod:`.failover`)::

    per group k   land (its READs posted while group k - 1 was installed, or now) -> zero fills,
                  value / FP8 steps -> checksums -> post group k + 1 where its ring bytes differ
                  -> hand group k over
    READ from R   (landing group k, or posting k + 1; the other READs drained first)
    fails         exclude R -> fence: R's sequence and version still as at the start (it wrote
                  nothing while its bytes were read), each replacement rank at the fenced version,
                  its sequence read before its bytes -> re-plan onto the other holders -> the same
                  groups, same ring offsets, cut from the new plan, prepared again (the ring is
                  reused: no second ring nor arena; ring + scratch still within the budget) -> the
                  failed group pulled again from the new holders, and the rest

In a node group (:mod:`.node_stream`) each group, once landed, serves its owned shared targets
to the node-mates, posts group ``k + 1``, then copies its targets the mates own from their node
arenas (a mate that fails: its targets pulled here, ``k + 1`` landed again; a trainer rank that fails
during that pull: failed over, group ``k`` landed again from the other holders).

Groups handed over before the failure stay: they hold the fenced version, and the end fence
still checks every rank read (R up to the failure, its replacements from it) for a move or a
write, so a mix of versions is still reported (TornUpdateError), never handed on silently.
With no other holder of some tensor R served, the cycle fails naming R (TransferError); a
fence that no longer holds at the failover ends the cycle torn (``error``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Protocol

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.online.receiver.cycle import StaleVersionError, TornUpdateError
from megarefit.online.receiver.delta_direct import DirectDelta
from megarefit.online.receiver.failover import Failover
from megarefit.online.receiver.fence import FenceStart, VersionFence
from megarefit.online.receiver.integrity import ChecksumVerifier
from megarefit.online.receiver.memory import ReceiverMemory, StreamRing
from megarefit.online.receiver.node_stream import NodeStream
from megarefit.online.receiver.plan_cache import PlanCache
from megarefit.online.receiver.stream import regroup, sub_plan
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.transport.checksum import ChecksumMismatchError
from megarefit.transport.execute import run_value_step
from megarefit.transport.nixl import InFlight, NixlTransport
from megarefit.transport.nixl_agent import TransferError


class StreamParts(Protocol):
    """The receiver's parts a streamed cycle runs over (a CyclePipeline has them)."""

    fence: VersionFence
    plans: PlanCache
    memory: ReceiverMemory
    transport: NixlTransport
    verifier: ChecksumVerifier | None
    failover: Failover
    direct_delta: DirectDelta
    timeout: float
    read_timeout: float  # a pull's READs (transfer_timeout, else timeout)
    node_stream: NodeStream | None  # a streamed node group's node arena and copies from mates


_AGAIN = object()  # _from_mates: a trainer rank failed over, group k is landed again


class GroupStream:
    """The groups of one streamed cycle (see the module docstring); iterate :meth:`run`.

    ``start`` / ``plan`` / ``prepared``: the fence, plan and prepared READs, replaced at a failover;
    ``failovers``: ``(rank, the ranks that serve its share)`` per failover; ``verified``: (checked
    bytes, checked boxes); ``error``: the TornUpdateError that ended the cycle at a failover, or ``None``."""

    def __init__(self, parts: StreamParts, start: FenceStart, plan: Plan, prepared: list, *, patched: bool):
        self.parts, self.start, self.plan, self.prepared = parts, start, plan, prepared
        self.patched = patched  # direct targets patched with a delta: the groups stream the rest
        self.check = parts.verifier is not None
        self.verified = (0, 0)
        self.failovers: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = []
        self.error: TornUpdateError | None = None

    @property
    def stream(self) -> StreamRing:
        """The receiver's ring and its groups (regrouped at a failover)."""
        stream = self.parts.memory.stream
        assert stream is not None
        return stream

    def run(self) -> Generator[tuple[str, torch.Tensor], None, float]:
        """Hand over each group's tensors in turn (views of the ring, valid until the next item
        is asked for); group ``k + 1``'s READs are posted before group ``k`` is handed over when
        their ring bytes differ, else after. Returns the seconds spent pulling (waiting for
        READs, placing, FP8 steps, failing over), not installing.

        Raises:
            TransferError: a READ failed and no other rank holds what its rank served (names it).
            ChecksumMismatchError / TornUpdateError: see :meth:`_check_group`."""
        pull_s, flight, k = 0.0, None, 0
        try:
            while k < len(self.stream.groups):
                t_pull = time.perf_counter()
                try:
                    self._land(k, flight)
                except TransferError as exc:  # drained: nothing more lands from that flight
                    flight = None
                    self._fail_over(exc, k)
                    pull_s += time.perf_counter() - t_pull
                    if self.error is not None:
                        break
                    continue  # group k again, from the other holders
                flight = None
                if self.parts.node_stream is not None:  # group k + 1's READs fly while the mates' copies run
                    flight = self._from_mates(k, self._post_next(k))
                    if flight is _AGAIN:  # failed over while pulling a mate's share: group k from the new plan
                        flight = None
                        pull_s += time.perf_counter() - t_pull
                        if self.error is not None:
                            break
                        continue
                if self.check and not self._check_group(k):
                    self.check = False
                if self.parts.node_stream is None:
                    flight = self._post_next(k)
                pull_s += time.perf_counter() - t_pull
                if self.error is not None:
                    break
                group, bufs = self.stream.groups[k], self.stream.buffers[k]
                for ref, tensor in bufs.items():
                    if ref not in group.plan.staging and ref not in self.stream.direct:
                        yield ref.name, tensor  # valid until the next item is requested
                k += 1
        finally:
            if flight is not None and not flight.done:  # the consumer stopped early: let the READs land
                with contextlib.suppress(MegarefitError):
                    self.parts.transport.wait(flight, timeout=self.parts.read_timeout)
            if self.parts.node_stream is not None and k < len(self.stream.groups):  # mates must not wait for it
                self.parts.node_stream.abandon()
        return pull_s

    def _post_next(self, k: int) -> InFlight | None:
        """Post group ``k + 1``'s READs now where its ring bytes differ from group ``k``'s; a
        READ that cannot be posted fails over (group ``k + 1`` is then posted when it is landed)."""
        groups, memory = self.stream.groups, self.parts.memory
        if k + 1 >= len(groups) or groups[k + 1].overlaps(groups[k]):
            return None
        memory.wait_consumer()  # group k + 1 lands where group k - 1 was: its copies must be done
        try:
            return self.parts.transport.start(self.prepared[k + 1], timeout=self.parts.read_timeout)
        except TransferError as exc:  # (the READs posted before it were drained)
            self._fail_over(exc, k + 1)
            return None

    def _land(self, k: int, flight: InFlight | None) -> None:
        """Group ``k`` in the ring, finished: its READs (posted by ``flight``, else now) waited
        for, its zero fills and FP8 steps run."""
        transport, timeout = self.parts.transport, self.parts.read_timeout
        if flight is None:
            self.parts.memory.wait_consumer()  # the ring bytes handed over before may still be read by queued copies
            flight = transport.start(self.prepared[k], timeout=timeout)
        transport.wait(flight, timeout=timeout, grace=self.parts.timeout)
        self._finish_group(k)
        if self.parts.node_stream is not None:  # its owned shared targets served to the mates
            self.parts.node_stream.served(k, self.stream.groups[k], self.stream.buffers[k])

    def _from_mates(self, k: int, flight: InFlight | None) -> InFlight | object | None:
        """Group ``k``'s targets the mates own READ from their node arenas (``flight``: group
        ``k + 1``'s READs, in flight meanwhile); returns ``flight``, or ``None`` where a mate
        failed: then it was waited for, the mate's targets pulled (:meth:`_pull_missing`), and
        group ``k + 1`` is landed again from its new plan; ``_AGAIN`` where that pull's trainer
        rank failed too: it was failed over (:meth:`_fail_over`) and group ``k`` is landed again."""
        node = self.parts.node_stream
        assert node is not None
        group, bufs = self.stream.groups[k], self.stream.buffers[k]
        direct = {r.name: bufs[r] for r in group.plan.targets if r in self.stream.direct}
        got = node.from_mates(group, self.stream.ring, self.start.version, direct)
        if not got.missing:
            return flight
        if flight is not None:  # its requests are prepared again: it must have landed first (its bytes count)
            self.parts.transport.wait(flight, timeout=self.parts.read_timeout, grace=self.parts.timeout)
            node.copies.wire_bytes += self.prepared[k + 1].wire_bytes
        try:
            self._pull_missing(k, got.missing)
        except TransferError as exc:  # a trainer rank failed too: its share from the other holders, group k again
            self._fail_over(exc, k)
            return _AGAIN
        return None

    def _pull_missing(self, k: int, missing: list[TensorRef]) -> None:
        """A node-mate failed to serve group ``k``'s targets ``missing``: pull them from the
        trainers into the ring now, and prepare the later groups again with its targets pulled
        here (it is given up for the rest of the cycle: ``node_stream.copies.fallbacks``)."""
        parts, node = self.parts, self.parts.node_stream
        assert node is not None
        plans = node.exclude([g.plan for g in self.stream.groups])
        group = self.stream.groups[k].plan
        names = sorted({r.name for r in missing})
        plans[k] = sub_plan(group, [r for r in group.targets if r.name in names],
                            digest_of(group.digest, "node-fallback", names))
        again = parts.memory.prepare_again(self.start.manifests, k, plans)
        parts.memory.within_budget("pulling a node-mate's share")
        parts.transport.execute(again[0], self.stream.buffers[k], timeout=parts.read_timeout, grace=parts.timeout)
        node.copies.wire_bytes += again[0].wire_bytes
        self.prepared = self.prepared[:k + 1] + again[1:]

    def _finish_group(self, k: int) -> None:
        """After group ``k`` landed: zero its never-pulled boxes (the ring held another group),
        run its receiver-side FP8 steps, and wait for them on a GPU."""
        memory = self.parts.memory
        group, bufs = self.stream.groups[k], self.stream.buffers[k]
        for ref, meta in group.plan.targets.items():
            for box in meta.zero_fill:
                bufs[ref][box.slices()].zero_()
        for t in group.plan.transforms:
            run_value_step(t, bufs[t.staging], bufs[t.target])
        if not group.plan.quantize:
            return
        memory.group_quantizer(k)()
        if memory.device.type == "cuda":
            torch.cuda.synchronize(memory.device)

    def _check_group(self, k: int) -> bool:
        """Verify group ``k`` against the checksums; ``False`` (stop checking: the end fence
        reports the cycle torn) when a mismatch comes from a rank that wrote.

        Raises:
            ChecksumMismatchError: group 0 differs (nothing handed over yet).
            TornUpdateError: a later group differs, and no rank wrote (not retried)."""
        parts, start = self.parts, self.start
        assert parts.verifier is not None
        try:
            checked, boxes = parts.verifier.verify(self.stream.groups[k].plan, self.stream.buffers[k], start.manifests,
                                                   start.version)
        except ChecksumMismatchError as exc:
            if parts.fence.torn(start, k) is not None:
                return False
            if k == 0:
                raise
            raise TornUpdateError(f"{exc}; {k} earlier group(s) were already handed over, so the consumer holds a mix of "
                                  "versions: it must not serve until a refit cycle completes", retryable=False) from exc
        self.verified = (self.verified[0] + checked, self.verified[1] + boxes)
        return True

    def _fail_over(self, exc: TransferError, k: int) -> None:
        """Group ``k``'s READs from rank ``exc.rank`` failed: exclude that rank, fence its
        replacements, re-plan the groups onto them in the same ring and prepare them again
        (see the module docstring); ``error`` set instead where the fence no longer holds.

        Raises:
            TransferError: no other rank holds what it served (names it), or ``exc`` itself
                where it names no rank or a rank already excluded.
            MemoryBudgetError: the new holders' pulls need more scratch than the budget leaves."""
        parts = self.parts
        rank, replaced = parts.failover.fail(exc)
        first = self.start.manifests[min(self.start.manifests)]  # (its layout: any rank's)
        try:
            self.start = parts.fence.failed_over(self.start, RankCoord(*rank), parts.plans.ranks_for(first),
                                                 parts.timeout)
        except StaleVersionError as why:
            self.error = TornUpdateError(f"{why}; {k} group(s) were already handed over, so the consumer may hold a mix "
                                         "of versions: it must not serve until a refit cycle completes",
                                         retryable=why.retryable)
            self.error.__cause__ = why
            return
        self.failovers.append((rank, replaced))
        manifests = self.start.manifests
        plan, _ = parts.plans.plan_for(manifests)
        parts.plans.check_manifests(plan, manifests)
        if parts.verifier is not None:
            parts.verifier.require(plan, manifests)
            parts.verifier.pull(manifests, parts.read_timeout)
        parts.transport.connect(manifests, self.start.metadata)
        stream = self.stream
        stream.groups = regroup(stream.groups, plan)
        rest = parts.direct_delta.plans(plan, stream)[1] if self.patched else None  # (without the patched targets)
        if parts.node_stream is not None:  # (without what the mates fill)
            rest = parts.node_stream.exclude([g.plan for g in stream.groups])
        again = parts.memory.prepare_again(manifests, k, rest)
        self.prepared = self.prepared[:k] + again  # (groups before k: done)
        parts.memory.within_budget(f"failing over from trainer rank {rank}")
        self.plan = plan


__all__ = ["GroupStream", "StreamParts"]
