"""NIXL transport: plan ops as batched one-sided READs (UCX backend).

Receiver side, per source rank, all of that rank's ops become ONE prepared
transfer request: a remote descriptor list (each op's source run inside the
trainer's registered tensor) and a local one (the op's destination run in the
receiver's registered arena, or a scratch slot for strided targets). Requests
are prepared once and re-posted on every warm cycle; nothing is registered or
prepared again until a source re-registers its memory or the layout changes.

::

    trainer rank (tp=1)          receiver arena (one registration)
    [ linear_qkv (local) ]  --READ-->  [ q_proj | k_proj | v_proj | ... ]   contiguous pulls,
    [ linear_fc2 (local) ]  --READ-->  [ scratch slot ] --strided copy--> down_proj columns
    [ experts.weight1    ]  --READ-->  [ scratch slot ] --transposed copies--> experts.E.gate_proj / up_proj

A scratch op whose *source* box is strided (legacy GroupedMLP ``weight1`` /
``weight2``: per-expert ``[hidden, 2*ffn]`` blocks read as transposed gate / up
halves) pulls the smallest flat run holding its box; runs of one source tensor
that overlap or touch are merged, so each expert block crosses the wire once and
gate and up are both cut from the same scratch bytes.

The agent itself (registrations, counters) is :mod:`~megarefit.transport.nixl_agent`.

Ranks on the receiver's own GPU are not read over NIXL (UCX goes through the host between
two processes on one GPU): given :class:`~megarefit.transport.cuda_ipc.IpcSources`, their ops
compile into device copies from CUDA-IPC-mapped trainer memory
(:class:`~megarefit.transport.cuda_ipc.DeviceCopies`), launched by :meth:`NixlTransport.start`
beside the other ranks' READs and waited for by :meth:`NixlTransport.wait`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.boxcopy import BoxCopies
from megarefit.transport.cuda_ipc import DeviceCopies, IpcSources
from megarefit.transport.gather import Piece, plan_waves
from megarefit.transport.local import part_views
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type

SCRATCH_THREADS = 4
"""Intra-op threads for the strided scratch copies. Many small strided copies with
all cores' OpenMP threads, next to busy-polling NIXL progress threads, collapse:
measured on a 16-core host (Qwen3-0.6B, 4 trainers) 1.93 s with 16 threads vs
0.024 s with 4 (docs/benchmarks.md)."""


@contextlib.contextmanager
def _bounded_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if before > n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


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
class _Wave:
    handle: Any
    place: BoxCopies
    nbytes: int
    descriptors: int


@dataclass
class _SourcePulls:
    rank: RankCoord
    agent: str
    ops: list[CopyOp]
    handle: Any = None  # the direct READs (None: everything is gathered)
    waves: list[_Wave] = field(default_factory=list)
    descriptors: int = 0
    wire_bytes: int = 0  # bytes the READs move (gathered runs include their gaps)
    scratch_bytes: int = 0  # this rank's scratch (one or two halves)
    remote: list[tuple[int, int]] = field(default_factory=list)  # every descriptor's remote (address, bytes)
    dlists: tuple[Any, ...] = ()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _source_run(plan: Plan, op: CopyOp) -> tuple[int, int]:
    """Flat elements ``[first, stop)`` of the op's source that hold its source box."""
    if op.kind == "contiguous":
        return op.src_offset, op.src_offset + op.numel
    strides = _contiguous_strides(op.src_view or plan.sources[op.src].shape)
    last = op.src_offset + sum((n - 1) * st for n, st in zip(op.src_box.lengths, strides))
    return op.src_offset, last + 1


def _coalesce(items: list[tuple[tuple[int, int, int], tuple[int, int, int], int, int | None, CopyOp]]
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


class _RankLayout(NamedTuple):
    """One source rank's pulls: direct ``(remote, local, ops)`` groups, gathered ops, their source runs."""

    direct: list[tuple[tuple[int, int, int], tuple[int, int, int], list[CopyOp]]]
    gathered: list[CopyOp]
    pieces: list[Piece]
    rdev: int


def _local_memory(buffers: Mapping[Any, torch.Tensor]) -> tuple[str, int]:
    """The NIXL memory type and device id of the receiver's buffers (``("DRAM", 0)`` for none).

    Raises:
        TransferError: the buffers span several memories.
    """
    local_mem = {mem_type(t) for t in buffers.values()}
    if len(local_mem) > 1:
        raise TransferError(f"receiver buffers span memory types {sorted(local_mem)}; keep them on one device")
    (lmem, ldev), = local_mem or {("DRAM", 0)}
    return lmem, ldev


def _ops_by_rank(plan: Plan, manifests: Mapping[RankCoord, Manifest],
                 skip: frozenset[RankCoord] = frozenset()) -> dict[RankCoord, _SourcePulls]:
    """The plan's ops grouped per source rank (plan order kept), one :class:`_SourcePulls` each;
    ranks in ``skip`` (read through CUDA IPC) left out."""
    by_rank: dict[RankCoord, _SourcePulls] = {}
    for op in plan.ops:
        rank = op.src.rank
        assert rank is not None
        if rank in skip:
            continue
        pulls = by_rank.get(rank)
        if pulls is None:
            pulls = by_rank[rank] = _SourcePulls(rank, manifests[rank].agent, [])
        pulls.ops.append(op)
    return by_rank


@dataclass
class PreparedPlan:
    """Prepared transfer requests for one plan against one set of source memories."""

    key: tuple[str, ...]
    per_source: list[_SourcePulls]
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


@dataclass
class InFlight:
    """READs of one prepared plan posted by :meth:`NixlTransport.start`, not yet waited for."""

    prepared: PreparedPlan
    posted: float  # perf_counter seconds when the first READ was posted
    pending: list[tuple[_SourcePulls, int]] = field(default_factory=list)  # (source, wave or -1: direct READ)
    queued: list[tuple[_SourcePulls, int, Any]] = field(default_factory=list)  # wave to post after its event
    local: tuple[Any, Any] | None = None  # CUDA events around the CUDA IPC copies (start, end)

    @property
    def done(self) -> bool:
        return not self.pending and not self.queued and (self.local is None or self.local[1].query())


class NixlTransport:
    """Executes whole plans over NIXL into preallocated target buffers.

    ``direct_min_bytes`` / ``max_direct`` / ``gap_bytes`` / ``scratch_budget``: see
    :data:`DIRECT_MIN_BYTES`, :data:`MAX_DIRECT`, :data:`GAP_BYTES`, :data:`SCRATCH_FRACTION`
    (``scratch_budget=None``: the default budget). ``ipc``: ranks it opens are read through
    CUDA IPC instead (:mod:`~megarefit.transport.cuda_ipc`); ``None``: every rank over NIXL.
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = False,
                 direct_min_bytes: int = DIRECT_MIN_BYTES, gap_bytes: int = GAP_BYTES,
                 scratch_budget: int | None = None, max_direct: int = MAX_DIRECT, ipc: IpcSources | None = None):
        # The receiver drives progress itself while it polls for completion; a
        # progress thread would only busy-poll a core (inside a vLLM worker, one
        # taken from inference). Publishers keep theirs: peers need it to connect.
        self.nixl = NixlAgent(name, backends=backends, progress_thread=progress_thread)
        self.direct_min_bytes, self.gap_bytes, self.scratch_budget = direct_min_bytes, gap_bytes, scratch_budget
        self.max_direct = max_direct
        self.ipc = ipc
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata loaded
        self._prepared: dict[tuple[str, ...], list[PreparedPlan]] = {}  # one prepared set at a time
        self._scratch: torch.Tensor | None = None
        self._blocks: dict[tuple, tuple[Any, ...]] = {}  # read_blocks: (agent, addr, nbytes, local) -> request
        self.last_seconds: dict[str, float] = {}

    @property
    def counters(self) -> Counter[str]:
        return self.nixl.counters

    @property
    def scratch_allocated(self) -> int:
        """Bytes of scratch allocated (and registered) for gathered pulls; it only grows."""
        return 0 if self._scratch is None else self._scratch.numel()

    @property
    def prepared(self) -> list[PreparedPlan]:
        """The prepared plans of the last :meth:`prepare` / :meth:`prepare_groups` (empty before)."""
        return next(iter(self._prepared.values()), [])

    def connect(self, manifests: Mapping[RankCoord, Manifest], metadata: Mapping[RankCoord, bytes]) -> None:
        """Load each source's NIXL metadata (NIXL's own metadata exchange); once per agent.

        A source that re-registered (e.g. a restarted trainer: same agent name, new
        metadata) replaces its old entry, and requests prepared against it are released.
        With ``ipc``, ranks on this GPU are opened through CUDA IPC instead (re-opened when
        their exports change).

        Raises:
            TransferError: metadata names another agent than the manifest.
            IpcError: ``transport="ipc"`` and a rank cannot be read through CUDA IPC.
        """
        if self.ipc is not None and self.ipc.connect(manifests):
            self._release_prepared()  # requests and copies against the old mappings
        local = self._ipc_ranks()
        for rank, blob in metadata.items():
            name = manifests[rank].agent
            if rank in local or not blob or self._remotes.get(name) == blob:
                continue
            if name in self._remotes:
                self._release_prepared()
                self.nixl.agent.remove_remote_agent(name)
                del self._remotes[name]
            added = self.nixl.agent.add_remote_agent(blob)
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise TransferError(f"rank {rank}: NIXL metadata names agent {added!r}, manifest says {name!r}")
            self._remotes[name] = blob
            self.nixl.counters["remote_agents"] += 1

    def release_scratch(self) -> int:
        """Drop every prepared request and free the scratch (deregistered first); bytes freed. The
        next :meth:`prepare` allocates it again."""
        self._release_prepared()
        if self._scratch is None:
            return 0
        freed = self._scratch.numel()
        self.nixl.deregister([self._scratch])
        self._scratch = None
        return freed

    def _ipc_ranks(self) -> frozenset[RankCoord]:
        return frozenset() if self.ipc is None else self.ipc.ranks

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Drop every prepared request and deregister ``tensors`` (registered together by
        :meth:`NixlAgent.register`), before the caller frees them."""
        self._release_prepared()
        self.nixl.deregister(tensors)

    def _release_prepared(self) -> None:
        for group in self._prepared.values():
            for pulls in (p for prepared in group for p in prepared.per_source):
                for handle in (pulls.handle, *(w.handle for w in pulls.waves), *pulls.dlists):
                    if handle is not None:
                        with contextlib.suppress(Exception):
                            handle.release()
        self._prepared = {}
        for handles in self._blocks.values():
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.release()
        self._blocks = {}

    def read_blocks(self, reads: Sequence[tuple[Manifest, tuple[int, int, str, int], torch.Tensor]], *,
                    timeout: float = 60.0) -> None:
        """READ whole registered blocks of sources (``(manifest, (addr, nbytes, mem, dev),
        local)``: ``nbytes`` from ``addr`` of the manifest's agent into the contiguous
        ``local``, registered here once), all posted at once; requests prepared once.

        Raises:
            TransferError: as :meth:`execute`."""
        agent = self.nixl.agent
        posted = []
        local_ranks = self._ipc_ranks()
        for manifest, (addr, nbytes, mem, dev), local in reads:
            if manifest.rank in local_ranks:  # a device copy from the mapped block
                assert self.ipc is not None
                local.view(torch.uint8).view(-1).copy_(self.ipc.checksum_block(manifest.rank)[:nbytes], non_blocking=True)
                torch.cuda.current_stream(local.device).synchronize()
                continue
            key = (self._remote_name(manifest), addr, nbytes, local.data_ptr())
            if key not in self._blocks:
                self.nixl.register([local])
                lmem, ldev = mem_type(local)
                rh = agent.prep_xfer_dlist(key[0], [(addr, nbytes, dev)], mem)
                lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), nbytes, ldev)], lmem)
                self._blocks[key] = (agent.make_prepped_xfer("READ", lh, [0], rh, [0]), rh, lh)
            pulls = _SourcePulls(manifest.rank, key[0], [], self._blocks[key][0])
            self._post(pulls, pulls.handle)
            posted.append((pulls, -1))
        flight = InFlight(PreparedPlan((), []), time.perf_counter(), posted)
        deadline = time.monotonic() + timeout
        while flight.pending:
            self._poll(flight)
            if flight.pending and time.monotonic() > deadline:
                raise TransferError(self._describe(flight.pending[0][0], f"no completion after {timeout:.1f} s"))

    def prepare(self, plan: Plan, manifests: Mapping[RankCoord, Manifest],
                buffers: Mapping[TensorRef, torch.Tensor]) -> PreparedPlan:
        """Prepare (or fetch from cache) the READ requests of ``plan``: per source rank one
        request of direct pulls (large runs straight into their targets) and one per wave of
        gathered runs (small and strided pulls, see :mod:`~megarefit.transport.gather`).

        ``buffers`` are the targets (contiguous, registered here once). Cached by
        the plan digest and every source's memory digest.

        Raises:
            TransferError: buffers on several devices, or a rank serving from several.
        """
        return self.prepare_groups([plan], manifests, [buffers])[0]

    def prepare_groups(self, plans: Sequence[Plan], manifests: Mapping[RankCoord, Manifest],
                       buffers: Sequence[Mapping[TensorRef, torch.Tensor]]) -> list[PreparedPlan]:
        """:meth:`prepare` for plans executed one after the other (a streamed refit's groups),
        all kept prepared at once and sharing one scratch sized for the largest.

        ``buffers[i]`` are ``plans[i]``'s targets; buffers of different plans may share memory
        (ring slots). Cached by every plan digest and every source's memory digest; preparing
        another set releases the previous one's requests.

        Raises:
            TransferError: buffers on several devices, or a rank serving from several.
        """
        key = tuple(p.digest for p in plans) + tuple(manifests[r].memory_digest for r in sorted(manifests))
        cached = self._prepared.get(key)
        if cached is not None:
            return cached
        local = self._ipc_ranks() & manifests.keys()
        remote = {r: m for r, m in manifests.items() if r not in local}
        every = [t for b in buffers for t in b.values()]
        if remote:
            self.nixl.register(every)
        lmem, ldev = _local_memory({i: t for i, t in enumerate(every)})
        device = every[0].device if every else torch.device("cpu")
        # pass 1: per plan and rank, the direct descriptors and the gathered waves (addresses only)
        passes, need = [], 0
        for plan, bufs in zip(plans, buffers):
            by_rank = _ops_by_rank(plan, remote, local)
            layouts = {rank: self._rank_layout(plan, pulls, manifests[rank], bufs, ldev)
                       for rank, pulls in sorted(by_rank.items())}
            waves_of, scratch_bytes = self._plan_waves(layouts, bufs)
            passes.append((plan, bufs, by_rank, layouts, waves_of))
            need = max(need, scratch_bytes)
        self._ensure_scratch(need, device, (lmem, ldev), bool(every))
        # pass 2: descriptor lists, requests and the placement of each wave
        out = [self._prepare_pass2(key, *one, manifests, lmem, ldev) for one in passes]
        if local:
            assert self.ipc is not None
            for prepared, plan, bufs in zip(out, plans, buffers):
                ops = [op for op in plan.ops if op.src.rank in local]
                prepared.local = DeviceCopies.build(plan, ops, self.ipc.tensor, bufs) if ops else None
        self._release_prepared()  # keep only the current layout's requests
        self._prepared = {key: out}
        return out

    def _prepare_pass2(self, key: tuple[str, ...], plan: Plan, buffers: Mapping[TensorRef, torch.Tensor],
                       by_rank: dict[RankCoord, _SourcePulls], layouts: dict[RankCoord, _RankLayout],
                       waves_of: dict[RankCoord, tuple[list, int]], manifests: Mapping[RankCoord, Manifest],
                       lmem: str, ldev: int) -> PreparedPlan:
        """One plan's descriptor lists, requests and wave placements (scratch from offset 0)."""
        prepared = PreparedPlan(key, [])
        base = 0
        for rank, pulls in sorted(by_rank.items()):
            waves, half = waves_of[rank]
            remote, local, spans, places = self._descriptors(plan, layouts[rank], waves, half, base, buffers, ldev)
            base += half * min(2, len(waves))
            pulls.scratch_bytes = half * min(2, len(waves))
            rmem = manifests[rank].by_name()[pulls.ops[0].src.name].mem
            self._make_requests(pulls, manifests[rank], remote, local, spans, places, (rmem, lmem),
                                bool(layouts[rank].direct))
            prepared.per_source.append(pulls)
        return prepared

    def _rank_layout(self, plan: Plan, pulls: _SourcePulls, manifest: Manifest,
                     buffers: Mapping[TensorRef, torch.Tensor], ldev: int) -> _RankLayout:
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
        groups = sorted(_coalesce(items), key=lambda g: -g[0][1])
        cut = sum(1 for g in groups[:self.max_direct] if g[0][1] >= self.direct_min_bytes)
        direct = sorted(groups[:cut], key=lambda g: g[0][0])  # the largest, in trainer order
        small = {id(op) for g in groups[cut:] for op in g[2]}
        gathered = [op for op in pulls.ops if op.kind != "contiguous" or id(op) in small]
        pieces = []
        for i, op in enumerate(gathered):
            first, stop = _source_run(plan, op)
            e = entries[op.src.name]
            pieces.append(Piece(e.region, e.addr + first * op.itemsize, (stop - first) * op.itemsize, i))
        return _RankLayout(direct, gathered, pieces, rdev)

    def _plan_waves(self, layouts: Mapping[RankCoord, _RankLayout], buffers: Mapping[TensorRef, torch.Tensor]
                    ) -> tuple[dict[RankCoord, tuple[list, int]], int]:
        """(rank -> (gathered waves, scratch half size), total scratch bytes): the scratch budget is
        shared by the ranks that gather; a rank whose runs do not fit its share reads them in
        waves through two halves."""
        budget = self.scratch_budget
        if budget is None:
            total = sum(b.numel() * b.element_size() for b in buffers.values())
            budget = max(SCRATCH_MIN_BYTES, int(SCRATCH_FRACTION * total))
        share = budget // max(1, sum(1 for v in layouts.values() if v.pieces))
        waves_of: dict[RankCoord, tuple[list, int]] = {}  # rank -> (waves, half size)
        scratch_bytes = 0
        for rank, layout in layouts.items():
            pieces = layout.pieces
            waves = plan_waves(pieces, cap=share, gap=self.gap_bytes) if pieces else []
            if len(waves) > 1:  # does not fit in one go: two halves, reused
                waves = plan_waves(pieces, cap=max(1, share // 2), gap=self.gap_bytes)
            half = -(-max((w.nbytes for w in waves), default=0) // 256) * 256
            waves_of[rank] = (waves, half)
            scratch_bytes += half * min(2, len(waves))
        return waves_of, scratch_bytes

    def _ensure_scratch(self, scratch_bytes: int, device: torch.device, local: tuple[str, int],
                        check: bool) -> None:
        """(Re)allocate and register the scratch beside the buffers when it is too small or on
        another device; with ``check``, it must be in the buffers' memory ``local``.

        Raises:
            TransferError: the scratch's memory differs from the buffers'.
        """
        if scratch_bytes and (self._scratch is None or self._scratch.numel() < scratch_bytes
                              or self._scratch.device != device):
            self._scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)  # beside the buffers
            self.nixl.register([self._scratch])
        if scratch_bytes and mem_type(self._scratch) != local and check:
            raise TransferError(f"scratch memory {mem_type(self._scratch)} differs from the buffers' {local}")

    def _descriptors(self, plan: Plan, layout: _RankLayout, waves: list, half: int, base: int,
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
                local.append((self._scratch.data_ptr() + at + run.slot, run.nbytes, ldev))  # type: ignore[union-attr]
                for i, off in run.pieces:
                    pairs.append(self._placement(plan, gathered[i], pieces[i].nbytes, at + run.slot + off, buffers))
            spans.append((first, len(remote)))
            places.append((BoxCopies(pairs), wave.nbytes, len(remote) - first))
        return remote, local, spans, places

    def _make_requests(self, pulls: _SourcePulls, manifest: Manifest, remote: list[tuple[int, int, int]],
                       local: list[tuple[int, int, int]], spans: list[tuple[int, int]], places: list,
                       mems: tuple[str, str], direct: bool) -> None:
        """Prepare the rank's remote and local descriptor lists (memory types ``mems``) and one READ
        request per span into ``pulls``: the direct one (if ``direct``) and one per wave."""
        rmem, lmem = mems
        pulls.descriptors, pulls.wire_bytes = len(remote), sum(n for _, n, _ in remote)
        pulls.remote = [(a, n) for a, n, _ in remote]
        agent = self.nixl.agent
        rh = agent.prep_xfer_dlist(self._remote_name(manifest), remote, rmem)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, lmem)
        pulls.dlists = (lh, rh)
        self.nixl.counters["dlists"] += 2
        handles = []
        for lo, hi in spans:
            idx = list(range(lo, hi))
            handles.append(agent.make_prepped_xfer("READ", lh, idx, rh, idx))
            self.nixl.counters["xfers"] += 1
        if direct:
            pulls.handle = handles.pop(0)
        pulls.waves = [_Wave(h, place, nbytes, n) for h, (place, nbytes, n) in zip(handles, places)]

    def _placement(self, plan: Plan, op: CopyOp, nbytes: int, at: int, buffers: Mapping[TensorRef, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination view, scratch view) of a gathered op whose source run starts at
        scratch byte ``at``."""
        assert self._scratch is not None
        out = buffers[op.dst]
        flat = self._scratch[at: at + nbytes].view(out.dtype)
        if op.kind == "contiguous":
            return out.view(-1)[op.dst_offset: op.dst_offset + op.numel], flat
        part = flat.as_strided(op.src_box.lengths, _contiguous_strides(op.src_view or plan.sources[op.src].shape))
        return part_views(op, part, out)

    def execute(self, prepared: PreparedPlan, buffers: Mapping[TensorRef, torch.Tensor], *,
                timeout: float = 60.0) -> None:
        """Post every source's direct READ and first two waves, and wait (:meth:`start`, then
        :meth:`wait`). Each wave is placed (one batched copy) as soon as it lands, and the wave
        after next reuses its scratch half once that placement has finished, overlapping the
        other READs.

        Raises:
            TransferError: a peer disconnected, a transfer failed, or ``timeout``
                seconds passed; the message names the peer, its first tensors
                and byte ranges.
        """
        self.wait(self.start(prepared), timeout=timeout)

    def start(self, prepared: PreparedPlan) -> InFlight:
        """Post every source's direct READ and its first two waves; return without waiting.
        The READs move while the caller does other work (a streamed receiver hands the
        previous group over meanwhile); :meth:`wait` places the waves and finishes. Nothing
        else may use the scratch until then.

        Raises:
            TransferError: a READ could not be posted (names the peer and its first tensors)."""
        flight = InFlight(prepared, time.perf_counter())
        for pulls in prepared.per_source:
            if pulls.handle is not None:
                self._post(pulls, pulls.handle)
                flight.pending.append((pulls, -1))
            for w in range(min(2, len(pulls.waves))):
                self._post(pulls, pulls.waves[w].handle)
                flight.pending.append((pulls, w))
        if prepared.local is not None:  # CUDA IPC ranks: device copies, asynchronous on the current stream
            device = prepared.local.device
            with torch.cuda.device(device):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                prepared.local()
                end.record()
            flight.local = (begin, end)
            self.nixl.counters["ipc_launches"] += 1
        return flight

    def _post(self, pulls: _SourcePulls, handle: Any) -> None:
        try:
            self.nixl.agent.transfer(handle)
        except Exception as exc:  # nixl raises its own error types per failure
            raise TransferError(self._describe(pulls, f"could not post READ: {exc!r}")) from exc
        self.nixl.counters["posts"] += 1

    def wait(self, flight: InFlight, *, timeout: float = 60.0) -> None:
        """Finish a :meth:`start`: place each wave as it lands, post the later waves as
        scratch halves free up, until every READ is done; ``last_seconds``: ``read`` (from
        post to done, less placements) and ``scratch`` (placements) seconds.

        Raises:
            TransferError: a transfer failed, or ``timeout`` seconds passed (from this call)."""
        deadline = time.monotonic() + timeout
        scratch_s = 0.0
        gpu: torch.device | None = None  # the device of the fused placements, if any
        while flight.pending or flight.queued:
            landed = self._poll(flight)
            for pulls, w in landed:
                t0 = time.perf_counter()
                place = pulls.waves[w].place
                with _bounded_threads(SCRATCH_THREADS):
                    place()
                event = None
                if place.fused:  # recorded on the stream of the device the copies ran on
                    gpu = place.device
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(gpu))
                scratch_s += time.perf_counter() - t0
                if w + 2 < len(pulls.waves):
                    flight.queued.append((pulls, w + 2, event))
            waiting = []
            for pulls, w, event in flight.queued:
                if event is None or event.query():
                    self._post(pulls, pulls.waves[w].handle)
                    flight.pending.append((pulls, w))
                else:
                    waiting.append((pulls, w, event))
            flight.queued = waiting
            if (flight.pending or flight.queued) and time.monotonic() > deadline:
                who = flight.pending[0][0] if flight.pending else flight.queued[0][0]
                raise TransferError(self._describe(who, f"no completion after {timeout:.1f} s"))
        if gpu is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(gpu).synchronize()
            scratch_s += time.perf_counter() - t0
        ipc_s = None
        if flight.local is not None:
            flight.local[1].synchronize()
            ipc_s = flight.local[0].elapsed_time(flight.local[1]) / 1e3
        total = time.perf_counter() - flight.posted
        self.last_seconds = {"read": total - scratch_s, "scratch": scratch_s}
        if ipc_s is not None:
            self.last_seconds["ipc"] = ipc_s

    def _poll(self, flight: InFlight) -> list[tuple[_SourcePulls, int]]:
        """Check every pending READ once; keep the unfinished, return the landed waves.

        Raises:
            TransferError: a transfer failed or reported ERR."""
        agent = self.nixl.agent
        still, landed = [], []
        for pulls, w in flight.pending:
            handle = pulls.handle if w < 0 else pulls.waves[w].handle
            try:
                state = agent.check_xfer_state(handle)
            except Exception as exc:
                raise TransferError(self._describe(pulls, f"transfer failed: {exc!r}")) from exc
            if state == "ERR":
                raise TransferError(self._describe(pulls, "transfer reported ERR"))
            if state != "DONE":
                still.append((pulls, w))
            elif w >= 0:
                landed.append((pulls, w))
        flight.pending = still
        return landed

    def _remote_name(self, manifest: Manifest) -> str:
        if manifest.agent not in self._remotes:
            raise TransferError(f"rank {manifest.rank}: NIXL agent {manifest.agent!r} was never connected")
        return manifest.agent

    @staticmethod
    def _describe(pulls: _SourcePulls, what: str) -> str:
        first = ", ".join(f"{op.src.name} bytes [{op.src_byte_offset}, {op.src_byte_offset + op.nbytes})"
                          for op in pulls.ops[:3])
        rank = f"{pulls.rank.tp}.{pulls.rank.pp}.{pulls.rank.ep}"
        return (f"READ from peer {pulls.agent!r} (trainer rank {rank} as tp.pp.ep) of {len(pulls.ops)} ops "
                f"({sum(op.nbytes for op in pulls.ops)} bytes): {what}; first ops: {first}")
