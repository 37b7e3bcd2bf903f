"""A staged receiver's node-group pull with its same-host copies overlapping its NIC reads.

A staged node-mate (:mod:`.node_share`) used to pull its whole share, fence it, serve its arena
and only then copy what its mates pulled. Here the plan's targets are cut into layer groups (the
plan's order, whole layers, about equal bytes) and the arena is served while it fills
(``serve_filling``: progress in bytes of its layout, which is laid out in group order)::

    group k     this receiver's READs of group k from the trainers (its own share only) land
                -> progress published (mates may READ group k's targets it owns now)
                -> group k + 1's READs posted
                -> group k's targets a mate owns READ from that mate's arena, once its
                   progress covers them (same-host path), while group k + 1's READs fly

Each mate publishes group ``k``'s progress before it waits for its mates' group ``k``; with whole
layers in one order on every mate, no two mates wait on each other. The end fence comes after the
copies, so it covers every trainer rank while the mates' bytes were read too: a rank that wrote
meanwhile tears the cycle, never a silent mix (as for streamed node arenas, :mod:`.node_stream`).
A mate that fails leaves its targets in ``missing`` (pulled from the trainers by the caller, fenced
again). A READ of this receiver's own that fails gives the arena up (``ABANDONED``: mates pull those
targets themselves) and raises.

Only where the pull leaves the bytes as they land: plans that quantize on the receiver or run
value steps after the pull (:attr:`~megarefit.plan.Plan.quantize`, ``transforms``) serve their arena
once processed, whole (:func:`overlaps` is false).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megarefit.online.receiver.node_share import NodeCopies, NodeShare
from megarefit.online.receiver.replica_chunks import ABANDONED
from megarefit.online.receiver.stream import layer_runs, sub_plan, target_bytes
from megarefit.plan import Plan, TensorRef, digest_of
from megarefit.transport.execute import torch_dtype
from megarefit.transport.nixl import NixlTransport

__all__ = ["GROUPS", "GroupedPull", "StagedNodePull", "abandon_on_error", "overlaps"]

log = logging.getLogger(__name__)

GROUPS = 8  # layer groups a staged node pull is cut into (at most; one per layer where fewer)


@contextmanager
def abandon_on_error(share: NodeShare | None) -> Iterator[None]:
    """Give the arena served while it filled up (``ABANDONED``) where the cycle fails after the grouped pull,
    before it is fenced (torn, checksums, the receiver-side steps): mates never take unfenced bytes of a
    failed cycle for a finished one. ``share`` ``None``: nothing to do."""
    try:
        yield
    except BaseException:
        if share is not None:
            share.landed(ABANDONED)
        raise


def overlaps(plan: Plan, share: NodeShare) -> bool:
    """The pull can serve its arena while it fills: a split shares something, and nothing is processed after
    the pull (no receiver-side quantization, no value steps)."""
    return bool(share.copies() or share.owned()) and not plan.quantize and not plan.transforms \
        and len(layer_runs(plan)) > 1


def _groups(plan: Plan) -> list[list[TensorRef]]:
    """The plan's targets in order, cut at layer boundaries into at most :data:`GROUPS` runs of about equal bytes."""
    runs = layer_runs(plan)
    total = sum(target_bytes(plan, r) for _, refs in runs for r in refs)
    per, out, size = max(1, total // min(GROUPS, len(runs))), [[]], 0
    for _, refs in runs:
        if size >= per and out[-1]:
            out.append([])
            size = 0
        out[-1].extend(refs)
        size += sum(target_bytes(plan, r) for r in refs)
    return out


def _served_layout(layout: list, groups: list[list[TensorRef]]) -> tuple[list, list[int]]:
    """The arena's layout in group order, and per group the bytes of it landed once that group has."""
    order = {r.name: k for k, g in enumerate(groups) for r in g}
    served = sorted(layout, key=lambda e: order.get(e[0], len(groups)))
    per = [0] * (len(groups) + 1)
    for name, dtype, _, shape in served:
        per[order.get(name, len(groups))] += math.prod(int(d) for d in shape) * torch_dtype(dtype).itemsize
    return served, [sum(per[:k + 1]) for k in range(len(groups))]


@dataclass(frozen=True)
class GroupedPull:
    """What the grouped pull moved, as a staged cycle's stats read a prepared plan: ``wire_bytes`` and
    ``ipc_bytes`` summed over the groups, ``descriptors`` summed, ``scratch_bytes`` the largest (the groups
    share one scratch, :meth:`~megarefit.transport.nixl.NixlTransport.prepare_groups`); ``seconds``: the
    transport's ``last_seconds`` summed over the groups."""

    wire_bytes: int
    ipc_bytes: int
    scratch_bytes: int
    descriptors: int
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Layout:
    """One (plan, share, arena layout)'s groups, served layout, progress per group, byte offsets, sub-plans."""

    groups: list[list[TensorRef]]
    served: list
    landed: list[int]
    here: dict[str, int]
    subs: list[Plan]
    own: frozenset[str]


class StagedNodePull:
    """A staged receiver's grouped node pull (module docstring); keeps each plan's groups and sub-plans, so a
    warm cycle builds nothing (its sub-plans' prepared requests are the transport's, cached by digest)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, _Layout] = {}

    def _layout(self, plan: Plan, mine: Plan, layout: list) -> _Layout:
        key = (plan.digest, mine.digest, tuple(e[:3] for e in layout))
        if key not in self._cache:
            groups, own = _groups(plan), frozenset(r.name for r in mine.targets)
            served, landed = _served_layout(layout, groups)
            subs = [sub_plan(mine, [r for r in g if r.name in own], digest_of(mine.digest, "node-staged", k,
                                                                               len(groups))) for k, g in enumerate(groups)]
            here = {n: o * torch_dtype(d).itemsize for n, d, o, _ in layout}
            self._cache = {key: _Layout(groups, served, landed, here, subs, own)}  # the current plan's only
        return self._cache[key]

    def pull(self, transport: NixlTransport, share: NodeShare, plan: Plan, mine: Plan, manifests: Mapping,
             arenas: dict[str, torch.Tensor], layout: list, buffers: Mapping[TensorRef, torch.Tensor],
             version: int, *, timeout: float, grace: float) -> tuple[GroupedPull, NodeCopies]:
        """Pull ``mine`` (``plan`` less the mates' share) group by group into the arena while serving it, and
        copy the mates' share of each group as it lands there (module docstring). Returns what was pulled
        and the copies (``missing``: targets of mates that failed, for the caller to pull and fence);
        ``GroupedPull.seconds["pull"]``: the seconds of the pull less the waits for and READs from mates.

        Raises:
            TransferError: a READ from the trainers failed. On any error the READs still in flight are
                waited for (a late one sets ``transport.late``) and the arena is given up to the mates."""
        lay = self._layout(plan, mine, layout)
        t0 = time.perf_counter()
        prepared = transport.prepare_groups(lay.subs, manifests, [buffers] * len(lay.subs))
        share.serve_filling(arenas, lay.served, version, transport.nixl.metadata)
        out, seconds, flight = NodeCopies(), {}, None
        device = next(iter(arenas.values())).device if arenas else torch.device("cpu")
        try:
            flight = transport.start(prepared[0], timeout=timeout) if lay.subs[0].targets else None
            for k, group in enumerate(lay.groups):
                if flight is not None:
                    done, flight = flight, None
                    transport.wait(done, timeout=timeout, grace=grace)
                    for key, value in transport.last_seconds.items():
                        seconds[key] = seconds.get(key, 0.0) + value
                if device.type == "cuda":  # the waves' placements done before mates READ them
                    torch.cuda.synchronize(device)
                share.landed(lay.landed[k])
                if k + 1 < len(lay.groups) and lay.subs[k + 1].targets:
                    flight = transport.start(prepared[k + 1], timeout=timeout)
                _copy_group(share, transport, plan, arenas, lay.here, version, {r.name for r in group} - lay.own, out)
        except BaseException:
            _give_up(transport, share, flight, timeout, grace)
            raise
        seconds["pull"] = time.perf_counter() - t0 - out.wait_s - out.read_s
        pulled = GroupedPull(sum(p.wire_bytes for p in prepared), sum(p.ipc_bytes for p in prepared),
                             max(p.scratch_bytes for p in prepared), sum(p.descriptors for p in prepared), seconds)
        return pulled, out


def _give_up(transport: NixlTransport, share: NodeShare, flight: object, timeout: float, grace: float) -> None:
    """After an error mid-pull: the READs still in flight waited for (their failure sets ``transport.late``),
    the arena given up (mates pull those targets themselves); neither hides the error being raised."""
    if flight is not None:
        try:
            transport.wait(flight, timeout=timeout, grace=grace)  # type: ignore[arg-type]
        except Exception:  # the first error is the one raised; a late READ is in transport.late
            log.warning("node pull: READs in flight at an error ended badly too", exc_info=True)
    try:
        share.landed(ABANDONED)
    except Exception:  # as above: the store may be what failed
        log.warning("node pull: could not give the arena up to the mates", exc_info=True)


def _copy_group(share: NodeShare, transport: NixlTransport, plan: Plan, arenas: dict[str, torch.Tensor],
                here: Mapping[str, int], version: int, names: set[str], out: NodeCopies) -> None:
    """One group's targets the mates pulled, READ from them into the arena (:meth:`NodeShare.copy_targets`);
    those of a mate given up in an earlier group go to ``missing`` at once."""
    if not names:
        return
    failed = frozenset(m for m, _ in out.fallbacks)
    refs = {r.name: r for r in plan.targets}
    for mate, pieces in share.copies().items():
        if mate in failed:
            out.missing.extend(refs[p.name] for p in pieces if p.name in names)
    got = share.copy_targets(plan, transport.nixl, arenas, here, version, only=frozenset(names), skip=failed)
    out.bytes, out.wait_s, out.read_s = out.bytes + got.bytes, out.wait_s + got.wait_s, out.read_s + got.read_s
    out.fallbacks.extend(got.fallbacks)
    out.missing.extend(got.missing)
