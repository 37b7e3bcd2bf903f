"""Building NIXL READ requests for a plan (:class:`~megarefit.transport.nixl.NixlTransport`'s parts).

* :class:`RequestBuilder`: per source rank, the direct descriptors (large runs straight into
  their targets) and the gathered waves (small and strided runs through scratch, see
  :mod:`~megarefit.transport.gather`), their descriptor lists and prepared READ requests;
* :class:`Scratch`: the receiver's registered scratch for gathered runs (it only grows);
* :class:`PreparedPlan` / :class:`SourcePulls`: the prepared requests of one plan, per source rank;
  :func:`release_requests` releases them;
* :class:`GatherSizes`: the most scratch preparing a plan (or any group cut from it) can take,
  known from the plan alone (no addresses), so that a memory budget can allow for it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.boxcopy import BoxCopies
from megarefit.transport.cuda_ipc import DeviceCopies
from megarefit.transport.gather import Piece, plan_waves
from megarefit.transport.local import part_views
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type

DIRECT_MIN_BYTES = 16 << 20
"""A pull (after coalescing) smaller than this is gathered through scratch instead of
READ into its target directly. Measured on an H200 pair (docs/benchmarks.md): a refit's
direct READs of uneven 1-50 MB pieces ran at 0.67-0.89x of a one-descriptor READ's rate
with a 1 MiB threshold and 0.98-0.99x with 16 MiB, and the warm cycle went from
0.83-0.87x to 0.91-0.96x of raw NIXL on every layout tried; placing the gathered bytes is a
device copy at ~2 TB/s."""
MAX_DIRECT = 512
"""At most this many direct descriptors per source rank (the largest pulls); the rest are
gathered. Measured on an H200 pair: 1024 descriptors per trainer READ at raw speed,
4096 at 0.5-0.7x (docs/benchmarks.md)."""
GAP_BYTES = 256 << 10
"""Gathered pieces of one registered region at most this far apart are read as one run."""
SCRATCH_FRACTION = 0.05
SCRATCH_MIN_BYTES = 64 << 20
"""Default scratch budget: ``max(SCRATCH_MIN_BYTES, SCRATCH_FRACTION * target bytes)``,
split over the source ranks; a rank whose gathered runs do not fit its share reads them
in waves through two halves (ping-pong)."""


@dataclass
class PreparedWave:
    """One wave of gathered runs: its READ request, the copies placing it, its bytes and descriptors."""

    handle: Any
    place: BoxCopies
    nbytes: int
    descriptors: int


@dataclass
class SourcePulls:
    """One source rank's ops and their prepared READs (direct request, gathered waves, descriptor lists)."""

    rank: RankCoord
    agent: str
    ops: list[CopyOp]
    handle: Any = None  # the direct READs (None: everything is gathered)
    waves: list[PreparedWave] = field(default_factory=list)
    descriptors: int = 0
    wire_bytes: int = 0  # bytes the READs move (gathered runs include their gaps)
    scratch_bytes: int = 0  # this rank's scratch (one or two halves)
    remote: list[tuple[int, int]] = field(default_factory=list)  # every descriptor's remote (address, bytes)
    dlists: tuple[Any, ...] = ()
    stale: bool = False  # released (its source's NIXL metadata was replaced): prepared again before a READ


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def source_run(plan: Plan, op: CopyOp) -> tuple[int, int]:
    """Flat elements ``[first, stop)`` of the op's source that hold its source box."""
    if op.kind == "contiguous":
        return op.src_offset, op.src_offset + op.numel
    strides = contiguous_strides(op.src_view or plan.sources[op.src].shape)
    last = op.src_offset + sum((n - 1) * st for n, st in zip(op.src_box.lengths, strides))
    return op.src_offset, last + 1


def coalesce(items: list[tuple[tuple[int, int, int], tuple[int, int, int], int, int | None, CopyOp]]
              ) -> list[tuple[tuple[int, int, int], tuple[int, int, int], list[CopyOp]]]:
    """Join consecutive ``(remote, local, remote region, local region, op)`` pulls whose
    remote and local runs both continue each other inside one registered region on each
    side (e.g. an expert's gate, up and down pulls when the trainer's tensors and the
    receiver's targets are laid out back to back): fewer, larger descriptors, the same
    bytes. Region ``-1`` / ``None`` (unknown) never joins. Returns (remote, local, ops)."""
    out: list[tuple[tuple[int, int, int], tuple[int, int, int], list[CopyOp]]] = []
    last = (-1, None)
    for r, l, rr, lr, op in sorted(items, key=lambda i: (i[2], i[0][0])):  # trainer memory order
        if (out and rr >= 0 and lr is not None and (rr, lr) == last and out[-1][0][0] + out[-1][0][1] == r[0]
                and out[-1][1][0] + out[-1][1][1] == l[0]):
            pr, pl, ops = out[-1]
            out[-1] = ((pr[0], pr[1] + r[1], r[2]), (pl[0], pl[1] + l[1], l[2]), ops + [op])
        else:
            out.append((r, l, [op]))
        last = (rr, lr)
    return out


class RankLayout(NamedTuple):
    """One source rank's pulls: direct ``(remote, local, ops)`` groups, gathered ops, their source runs."""

    direct: list[tuple[tuple[int, int, int], tuple[int, int, int], list[CopyOp]]]
    gathered: list[CopyOp]
    pieces: list[Piece]
    rdev: int


def local_memory(buffers: Mapping[Any, torch.Tensor]) -> tuple[str, int]:
    """The NIXL memory type and device id of the receiver's buffers (``("DRAM", 0)`` for none).

    Raises:
        TransferError: the buffers span several memories.
    """
    local_mem = {mem_type(t) for t in buffers.values()}
    if len(local_mem) > 1:
        raise TransferError(f"receiver buffers span memory types {sorted(local_mem)}; keep them on one device")
    (lmem, ldev), = local_mem or {("DRAM", 0)}
    return lmem, ldev


def ops_by_rank(plan: Plan, manifests: Mapping[RankCoord, Manifest],
                 skip: frozenset[RankCoord] = frozenset()) -> dict[RankCoord, SourcePulls]:
    """The plan's ops grouped per source rank (plan order kept), one :class:`SourcePulls` each;
    ranks in ``skip`` (read through CUDA IPC) left out."""
    by_rank: dict[RankCoord, SourcePulls] = {}
    for op in plan.ops:
        rank = op.src.rank
        assert rank is not None
        if rank in skip:
            continue
        pulls = by_rank.get(rank)
        if pulls is None:
            pulls = by_rank[rank] = SourcePulls(rank, manifests[rank].agent, [])
        pulls.ops.append(op)
    return by_rank


@dataclass
class PreparedPlan:
    """Prepared transfer requests for one plan against one set of source memories."""

    key: tuple[str, ...]
    per_source: list[SourcePulls]
    local: DeviceCopies | None = None  # the ops of ranks read through CUDA IPC

    @property
    def wire_bytes(self) -> int:
        """Bytes one cycle moves: every READ (each direct pull, plus each gathered run whole,
        gaps between its pieces included) and every CUDA IPC copy."""
        return sum(p.wire_bytes for p in self.per_source) + self.ipc_bytes

    @property
    def ipc_bytes(self) -> int:
        """Bytes copied from ranks read through CUDA IPC."""
        return 0 if self.local is None else self.local.nbytes

    @property
    def scratch_bytes(self) -> int:
        """Receiver scratch memory the plan uses (bytes), reused every cycle."""
        return sum(p.scratch_bytes for p in self.per_source)

    @property
    def descriptors(self) -> int:
        return sum(p.descriptors for p in self.per_source)


def pull_error(pulls: SourcePulls, what: str) -> TransferError:
    """A :class:`TransferError` naming ``pulls`` (:func:`describe_pulls`), its ``rank`` set."""
    return TransferError(describe_pulls(pulls, what), rank=pulls.rank)


def describe_pulls(pulls: SourcePulls, what: str) -> str:
    """An error text naming the peer, the trainer rank, its first ops and their byte ranges."""
    first = ", ".join(f"{op.src.name} bytes [{op.src_byte_offset}, {op.src_byte_offset + op.nbytes})"
                      for op in pulls.ops[:3])
    rank = f"{pulls.rank.tp}.{pulls.rank.pp}.{pulls.rank.ep}" + (f".{pulls.rank.copy}" if pulls.rank.copy else "")
    return (f"READ from peer {pulls.agent!r} (trainer rank {rank} as tp.pp.ep) of {len(pulls.ops)} ops "
            f"({sum(op.nbytes for op in pulls.ops)} bytes): {what}; first ops: {first}")


def post_read(nixl: NixlAgent, pulls: SourcePulls, handle: Any) -> None:
    """Post the prepared READ ``handle`` of ``pulls`` on ``nixl``'s agent.

    Raises:
        TransferError: the READ could not be posted (names the peer and its first tensors)."""
    try:
        nixl.agent.transfer(handle)
    except Exception as exc:  # nixl raises its own error types per failure
        raise pull_error(pulls, f"could not post READ: {exc!r}") from exc
    nixl.counters["posts"] += 1


def release_requests(prepared: Iterable[PreparedPlan], blocks: Iterable[tuple[Any, ...]]) -> None:
    """Release every request and descriptor list of ``prepared`` and of the block reads ``blocks``
    (failures ignored: the peer may be gone)."""
    for pulls in (p for plan in prepared for p in plan.per_source):
        for handle in (pulls.handle, *(w.handle for w in pulls.waves), *pulls.dlists):
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.release()
    for handles in blocks:
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.release()


def release_stale(pulls: Iterable[SourcePulls]) -> None:
    """Release the requests and descriptor lists of ``pulls`` (their source's metadata is about to
    be replaced) and mark them stale: :meth:`RequestBuilder.rebuild` prepares them again."""
    for p in pulls:
        release_requests([PreparedPlan((), [p])], ())
        p.handle, p.dlists, p.stale = None, (), True
        for w in p.waves:
            w.handle = None


def _half(cap: int, piece: int) -> int:
    """Bytes of one scratch half whose waves are packed to ``cap`` bytes, when no gathered piece
    is larger than ``piece`` (a run is at most ``max(cap, piece)`` bytes, placed up to 15 bytes
    into its slot; halves are rounded up to 256 bytes)."""
    return -(-(max(cap, piece) + 15) // 256) * 256


@dataclass(frozen=True)
class GatherSizes:
    """Per source rank of one plan, the bytes of the pieces a prepare may gather through scratch
    (addresses unknown): the largest strided op's source run, every contiguous op's bytes
    (sorted), and how many contiguous ops write ``direct`` targets (the consumer's own tensors,
    not the ring). :meth:`scratch_bound` mirrors :meth:`RequestBuilder.waves_per_rank`."""

    strided: dict[RankCoord, int]
    contiguous: dict[RankCoord, list[int]]
    direct_ops: dict[RankCoord, int]

    @classmethod
    def of(cls, plan: Plan, direct: frozenset[TensorRef] = frozenset()) -> GatherSizes:
        strided: dict[RankCoord, int] = {}
        contiguous: dict[RankCoord, list[int]] = {}
        direct_ops: dict[RankCoord, int] = {}
        for op in plan.ops:
            rank = op.src.rank
            assert rank is not None
            if op.kind == "contiguous":
                contiguous.setdefault(rank, []).append(op.nbytes)
                direct_ops[rank] = direct_ops.get(rank, 0) + (op.dst in direct)
            else:
                first, stop = source_run(plan, op)
                strided[rank] = max(strided.get(rank, 0), (stop - first) * op.itemsize)
        return cls(strided, {rank: sorted(sizes) for rank, sizes in contiguous.items()}, direct_ops)

    def largest_piece(self, rank: RankCoord, direct_min_bytes: int, max_direct: int, ring_bytes: int) -> int:
        """The largest piece ``rank`` may gather (bytes; 0: none). A contiguous op of at least
        ``direct_min_bytes`` is READ directly unless the rank may have more than ``max_direct``
        coalesced runs that large: each holds such an op or that many bytes of smaller ones, and
        each lands in ``direct_min_bytes`` of a ring of ``ring_bytes`` or holds a direct target's op."""
        sizes = self.contiguous.get(rank, [])
        small = bisect.bisect_left(sizes, direct_min_bytes)
        dmin = max(1, direct_min_bytes)
        large_runs = min(len(sizes) - small + sum(sizes[:small]) // dmin,
                         ring_bytes // dmin + self.direct_ops.get(rank, 0))
        gathered = sizes[small - 1] if small else 0
        if large_runs > max_direct:
            gathered = sizes[-1]
        return max(self.strided.get(rank, 0), gathered)

    def scratch_bound(self, scratch_budget: int, *, direct_min_bytes: int, max_direct: int, ring_bytes: int) -> int:
        """The most scratch (bytes) preparing the plan, or any sub-plan of its ops (a streamed
        refit's group) in a ring of at most ``ring_bytes``, allocates with these settings: the
        ranks that gather share ``scratch_budget``; each reads its pieces in one wave of its share
        or in waves through two halves of half its share, a piece larger than that being a wave
        of its own."""
        ranks = self.strided.keys() | self.contiguous.keys()
        pieces = sorted((p for rank in ranks if (p := self.largest_piece(rank, direct_min_bytes, max_direct,
                                                                         ring_bytes))), reverse=True)
        most = 0
        for n in range(1, len(pieces) + 1):  # n ranks gather in a group: those with the largest pieces, at most
            share = scratch_budget // n
            most = max(most, sum(max(_half(share, p), 2 * _half(max(1, share // 2), p)) for p in pieces[:n]))
        return most


class Scratch:
    """The receiver's scratch for gathered runs: one uint8 tensor registered with ``nixl``,
    beside the target buffers; it only grows until :meth:`release`. An outgrown scratch stays
    allocated and registered (``retired``) until the requests prepared on it are released
    (:meth:`drop_retired`), or goes to a quarantine with the current one where READs into it
    are late (:meth:`take`): one scratch registration per transport otherwise."""

    def __init__(self, nixl: NixlAgent):
        self.nixl = nixl
        self.tensor: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []  # outgrown, each registered by its own register call

    @property
    def allocated(self) -> int:
        """Bytes allocated (and registered) for the current scratch."""
        return 0 if self.tensor is None else self.tensor.numel()

    def release(self) -> int:
        """Deregister and free the scratch (and any outgrown one); bytes freed."""
        freed = self.drop_retired()
        if self.tensor is None:
            return freed
        freed += self.tensor.numel()
        self.nixl.deregister([self.tensor])
        self.tensor = None
        return freed

    def drop_retired(self) -> int:
        """Deregister and free the outgrown scratch; call it once no prepared request uses it and
        no READ into it is in flight. Bytes freed."""
        freed = 0
        while self.retired:
            old = self.retired.pop()
            self.nixl.deregister([old])
            freed += old.numel()
        return freed

    def take(self) -> list[torch.Tensor]:
        """Hand over every scratch tensor, outgrown and current, still registered (to a quarantine:
        late READs may write them); the next :meth:`ensure` allocates a fresh one."""
        out = [*self.retired, *([] if self.tensor is None else [self.tensor])]
        self.tensor, self.retired = None, []
        return out

    def ensure(self, scratch_bytes: int, device: torch.device, local: tuple[str, int],
                        check: bool) -> None:
        """(Re)allocate and register the scratch beside the buffers when it is too small or on
        another device (the old one to ``retired``); with ``check``, it must be in the buffers'
        memory ``local``.

        Raises:
            TransferError: the scratch's memory differs from the buffers'.
        """
        if scratch_bytes and (self.tensor is None or self.tensor.numel() < scratch_bytes
                              or self.tensor.device != device):
            if self.tensor is not None:  # requests prepared on it may still exist: deregistered once released
                self.retired.append(self.tensor)
            self.tensor = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)  # beside the buffers
            self.nixl.register([self.tensor])
        if scratch_bytes and mem_type(self.tensor) != local and check:
            raise TransferError(f"scratch memory {mem_type(self.tensor)} differs from the buffers' {local}")


class PullSettings(Protocol):
    """The transport's tuning the builder reads at each prepare (callers may change it between)."""

    direct_min_bytes: int
    max_direct: int
    gap_bytes: int
    scratch_budget: int | None


class RequestBuilder:
    """Builds the prepared READ requests of plans: addresses from the manifests and the target
    buffers, descriptors into the buffers or ``scratch``, requests on ``nixl``'s agent.
    ``remote_name(manifest)``: the connected agent name of a source (raises if not connected)."""

    def __init__(self, nixl: NixlAgent, scratch: Scratch, settings: PullSettings,
                 remote_name: Callable[[Manifest], str]):
        self.nixl, self.scratch, self.settings, self.remote_name = nixl, scratch, settings, remote_name
        self.rank_prepares: Counter[RankCoord] = Counter()  # per source rank: its requests prepared (per plan)
        self._built: tuple | None = None  # what the last build was for (rebuild checks it)
        self._memory: dict[RankCoord, str] = {}  # each remote rank's memory digest at the last (re)build

    def _built_for(self, plans: Iterable[Plan], every: list[torch.Tensor], skip: frozenset[RankCoord]) -> tuple:
        s = self.settings
        return (tuple(p.digest for p in plans), tuple((t.data_ptr(), t.nbytes) for t in every), skip,
                (s.direct_min_bytes, s.max_direct, s.gap_bytes, s.scratch_budget),
                None if self.scratch.tensor is None else (id(self.scratch.tensor), self.scratch.tensor.data_ptr()))

    def build(self, key: tuple[str, ...], plans: Iterable[Plan], buffers: Iterable[Mapping[TensorRef, torch.Tensor]],
              manifests: Mapping[RankCoord, Manifest], remote: Mapping[RankCoord, Manifest],
              skip: frozenset[RankCoord], every: list[torch.Tensor]) -> list[PreparedPlan]:
        """One :class:`PreparedPlan` per plan (its ranks in ``remote``; ``skip`` left out), all
        sharing one scratch sized for the largest; ``every``: all target buffers (registered).

        Raises:
            TransferError: buffers on several devices, or a rank serving from several.
        """
        lmem, ldev = local_memory({i: t for i, t in enumerate(every)})
        device = every[0].device if every else torch.device("cpu")
        # pass 1: per plan and rank, the direct descriptors and the gathered waves (addresses only)
        passes, need = [], 0
        for plan, bufs in zip(plans, buffers):
            by_rank = ops_by_rank(plan, remote, skip)
            layouts = {rank: self.rank_layout(plan, pulls, manifests[rank], bufs, ldev)
                       for rank, pulls in sorted(by_rank.items())}
            waves_of, scratch_bytes = self.waves_per_rank(layouts, bufs)
            passes.append((plan, bufs, by_rank, layouts, waves_of))
            need = max(need, scratch_bytes)
        self.scratch.ensure(need, device, (lmem, ldev), bool(every))
        # pass 2: descriptor lists, requests and the placement of each wave
        out = [self.prepare_plan(key, *one, manifests, lmem, ldev) for one in passes]
        self._built = self._built_for(plans, every, skip)
        self._memory = {r: m.memory_digest for r, m in remote.items()}
        return out

    def prepare_plan(self, key: tuple[str, ...], plan: Plan, buffers: Mapping[TensorRef, torch.Tensor],
                       by_rank: dict[RankCoord, SourcePulls], layouts: dict[RankCoord, RankLayout],
                       waves_of: dict[RankCoord, tuple[list, int]], manifests: Mapping[RankCoord, Manifest],
                       lmem: str, ldev: int) -> PreparedPlan:
        """One plan's descriptor lists, requests and wave placements (scratch from offset 0)."""
        prepared = PreparedPlan(key, [])
        base = 0
        for rank, pulls in sorted(by_rank.items()):
            waves, half = waves_of[rank]
            remote, local, spans, places = self.descriptors(plan, layouts[rank], waves, half, base, buffers, ldev)
            base += half * min(2, len(waves))
            pulls.scratch_bytes = half * min(2, len(waves))
            rmem = manifests[rank].by_name()[pulls.ops[0].src.name].mem
            self.make_requests(pulls, manifests[rank], remote, local, spans, places, (rmem, lmem),
                                bool(layouts[rank].direct))
            prepared.per_source.append(pulls)
        return prepared

    def rank_layout(self, plan: Plan, pulls: SourcePulls, manifest: Manifest,
                     buffers: Mapping[TensorRef, torch.Tensor], ldev: int) -> RankLayout:
        """One source rank's pulls split into direct descriptors (the largest coalesced contiguous
        runs, at most ``max_direct`` of at least ``direct_min_bytes``, in trainer order) and gathered
        ops with their source runs as :class:`Piece` s (addresses only).

        Raises:
            TransferError: the rank serves its tensors from several memories.
        """
        rank = pulls.rank
        entries = manifest.by_name()
        remote_mem = {(entries[op.src.name].mem, entries[op.src.name].dev) for op in pulls.ops}
        if len(remote_mem) > 1:
            raise TransferError(f"trainer rank {rank} serves tensors from several memories {sorted(remote_mem)}; "
                                "a rank must keep its published tensors on one device")
        rdev = next(iter(remote_mem))[1]
        items = []
        for op in pulls.ops:
            if op.kind == "contiguous":
                r = (entries[op.src.name].addr + op.src_byte_offset, op.nbytes, rdev)
                l_addr = buffers[op.dst].data_ptr() + op.dst_byte_offset
                items.append((r, (l_addr, op.nbytes, ldev), entries[op.src.name].region,
                              self.nixl.region(l_addr, op.nbytes), op))
        groups = sorted(coalesce(items), key=lambda g: -g[0][1])
        cut = sum(1 for g in groups[:self.settings.max_direct] if g[0][1] >= self.settings.direct_min_bytes)
        direct = sorted(groups[:cut], key=lambda g: g[0][0])  # the largest, in trainer order
        small = {id(op) for g in groups[cut:] for op in g[2]}
        gathered = [op for op in pulls.ops if op.kind != "contiguous" or id(op) in small]
        pieces = []
        for i, op in enumerate(gathered):
            first, stop = source_run(plan, op)
            e = entries[op.src.name]
            pieces.append(Piece(e.region, e.addr + first * op.itemsize, (stop - first) * op.itemsize, i))
        return RankLayout(direct, gathered, pieces, rdev)

    def waves_per_rank(self, layouts: Mapping[RankCoord, RankLayout], buffers: Mapping[TensorRef, torch.Tensor],
                       sharing: int | None = None) -> tuple[dict[RankCoord, tuple[list, int]], int]:
        """(rank -> (gathered waves, scratch half size), total scratch bytes): the scratch budget is
        shared by the ranks that gather (``sharing``: how many, where ``layouts`` are some of
        them); a rank whose runs do not fit its share reads them in waves through two halves."""
        budget = self.settings.scratch_budget
        if budget is None:
            total = sum(b.numel() * b.element_size() for b in buffers.values())
            budget = max(SCRATCH_MIN_BYTES, int(SCRATCH_FRACTION * total))
        share = budget // max(1, sum(1 for v in layouts.values() if v.pieces) if sharing is None else sharing)
        waves_of: dict[RankCoord, tuple[list, int]] = {}  # rank -> (waves, half size)
        scratch_bytes = 0
        for rank, layout in layouts.items():
            pieces = layout.pieces
            waves = plan_waves(pieces, cap=share, gap=self.settings.gap_bytes) if pieces else []
            if len(waves) > 1:  # does not fit in one go: two halves, reused
                waves = plan_waves(pieces, cap=max(1, share // 2), gap=self.settings.gap_bytes)
            half = -(-max((w.nbytes for w in waves), default=0) // 256) * 256
            waves_of[rank] = (waves, half)
            scratch_bytes += half * min(2, len(waves))
        return waves_of, scratch_bytes

    def rebuild(self, key: tuple[str, ...], prepared: list[PreparedPlan], plans: Sequence[Plan],
                buffers: Sequence[Mapping[TensorRef, torch.Tensor]], manifests: Mapping[RankCoord, Manifest],
                skip: frozenset[RankCoord], every: list[torch.Tensor]) -> bool:
        """Prepare again only the source ranks of ``prepared`` (the last :meth:`build`, for the same
        plans, buffers, settings and scratch) whose memory digest changed or whose requests went
        stale (a declared move republished them); the other ranks' requests are kept. Each rebuilt
        rank's gathered runs go in its old scratch slot. Whether it did: ``False`` (nothing
        changed) where that does not hold exactly -- other plans or buffers, a rank added or
        gone, another count of ranks gathering, or a rank's runs that no longer fit its slot:
        the caller builds all.

        Raises:
            TransferError: a rebuilt rank serves from several memories."""
        moved = {r for r, d in self._memory.items() if r not in manifests or manifests[r].memory_digest != d}
        moved |= {p.rank for plan in prepared for p in plan.per_source if p.stale}
        remote = {r for r in manifests if r not in skip}
        if self._built != self._built_for(plans, every, skip) or remote != self._memory.keys() or not moved:
            return False
        lmem, ldev = local_memory({i: t for i, t in enumerate(every)})
        todo = self._moved_layouts(prepared, plans, buffers, manifests, moved, ldev)
        if todo is None:
            return False
        for k, i, fresh, base, layout, waves, half in todo:
            old = prepared[k].per_source[i]
            release_stale([old])
            remote_d, local_d, spans, places = self.descriptors(plans[k], layout, waves, half, base, buffers[k], ldev)
            rmem = manifests[fresh.rank].by_name()[fresh.ops[0].src.name].mem
            self.make_requests(fresh, manifests[fresh.rank], remote_d, local_d, spans, places, (rmem, lmem),
                               bool(layout.direct))
            fresh.scratch_bytes = old.scratch_bytes  # (its slot: the next ranks' bases stay)
            prepared[k].per_source[i] = fresh
        for plan in prepared:
            plan.key = key
        self._memory = {r: manifests[r].memory_digest for r in remote}
        return True

    def _moved_layouts(self, prepared: list[PreparedPlan], plans: Sequence[Plan],
                       buffers: Sequence[Mapping[TensorRef, torch.Tensor]], manifests: Mapping[RankCoord, Manifest],
                       moved: set[RankCoord], ldev: int) -> list[tuple] | None:
        """Per plan and moved rank: (plan index, position in ``per_source``, fresh pulls, scratch
        base, layout, waves, half); ``None`` where the count of ranks gathering changes or a moved
        rank's waves no longer fit its old scratch slot (addresses only: nothing is prepared)."""
        todo = []
        for k, (plan, bufs, old) in enumerate(zip(plans, buffers, prepared)):
            before = gathering = sum(1 for p in old.per_source if p.waves)
            base, mine, layouts = 0, [], {}
            for i, pulls in enumerate(old.per_source):
                if pulls.rank in moved:
                    fresh = SourcePulls(pulls.rank, manifests[pulls.rank].agent, pulls.ops)
                    layouts[pulls.rank] = self.rank_layout(plan, fresh, manifests[pulls.rank], bufs, ldev)
                    gathering += bool(layouts[pulls.rank].pieces) - bool(pulls.waves)
                    mine.append((k, i, fresh, base))
                base += pulls.scratch_bytes
            waves_of, _ = self.waves_per_rank(layouts, bufs, sharing=gathering)
            if gathering != before:
                return None
            for k_, i, fresh, base_ in mine:
                waves, half = waves_of[fresh.rank]
                if half * min(2, len(waves)) > old.per_source[i].scratch_bytes:
                    return None
                todo.append((k_, i, fresh, base_, layouts[fresh.rank], waves, half))
        return todo

    def descriptors(self, plan: Plan, layout: RankLayout, waves: list, half: int, base: int,
                     buffers: Mapping[TensorRef, torch.Tensor], ldev: int
                     ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[tuple[int, int]], list]:
        """(remote descriptors, local descriptors, request spans, wave placements) of one rank:
        its direct pulls first (one span), then each wave's runs into its scratch half (starting
        at scratch byte ``base``), each with (copies placing the wave, bytes, descriptors)."""
        direct, gathered, pieces, rdev = layout
        remote = [g[0] for g in direct]
        local = [g[1] for g in direct]
        spans = [(0, len(remote))] if remote else []
        places = []
        for w, wave in enumerate(waves):
            at = base + (w % 2) * half
            first = len(remote)
            pairs = []
            for run in wave.runs:
                remote.append((run.addr, run.nbytes, rdev))
                local.append((self.scratch.tensor.data_ptr() + at + run.slot, run.nbytes, ldev))  # type: ignore[union-attr]
                for i, off in run.pieces:
                    pairs.append(self.placement(plan, gathered[i], pieces[i].nbytes, at + run.slot + off, buffers))
            spans.append((first, len(remote)))
            places.append((BoxCopies(pairs), wave.nbytes, len(remote) - first))
        return remote, local, spans, places

    def make_requests(self, pulls: SourcePulls, manifest: Manifest, remote: list[tuple[int, int, int]],
                       local: list[tuple[int, int, int]], spans: list[tuple[int, int]], places: list,
                       mems: tuple[str, str], direct: bool) -> None:
        """Prepare the rank's remote and local descriptor lists (memory types ``mems``) and one READ
        request per span into ``pulls``: the direct one (if ``direct``) and one per wave."""
        rmem, lmem = mems
        pulls.descriptors, pulls.wire_bytes = len(remote), sum(n for _, n, _ in remote)
        pulls.remote = [(a, n) for a, n, _ in remote]
        agent = self.nixl.agent
        rh = agent.prep_xfer_dlist(self.remote_name(manifest), remote, rmem)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, lmem)
        pulls.dlists = (lh, rh)
        self.nixl.counters["dlists"] += 2
        self.rank_prepares[pulls.rank] += 1
        handles = []
        for lo, hi in spans:
            idx = list(range(lo, hi))
            handles.append(agent.make_prepped_xfer("READ", lh, idx, rh, idx))
            self.nixl.counters["xfers"] += 1
        if direct:
            pulls.handle = handles.pop(0)
        pulls.waves = [PreparedWave(h, place, nbytes, n) for h, (place, nbytes, n) in zip(handles, places)]

    def placement(self, plan: Plan, op: CopyOp, nbytes: int, at: int, buffers: Mapping[TensorRef, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination view, scratch view) of a gathered op whose source run starts at
        scratch byte ``at``."""
        assert self.scratch.tensor is not None
        out = buffers[op.dst]
        flat = self.scratch.tensor[at: at + nbytes].view(out.dtype)
        if op.kind == "contiguous":
            return out.view(-1)[op.dst_offset: op.dst_offset + op.numel], flat
        part = flat.as_strided(op.src_box.lengths, contiguous_strides(op.src_view or plan.sources[op.src].shape))
        return part_views(op, part, out)


__all__ = ["DIRECT_MIN_BYTES", "GAP_BYTES", "MAX_DIRECT", "SCRATCH_FRACTION", "SCRATCH_MIN_BYTES", "GatherSizes",
           "PreparedPlan", "PullSettings", "RankLayout", "RequestBuilder", "Scratch", "SourcePulls", "PreparedWave",
           "coalesce", "contiguous_strides", "describe_pulls", "local_memory", "ops_by_rank", "post_read",
           "release_requests", "release_stale", "source_run"]
