"""NIXL transport: plan ops as batched one-sided READs (UCX backend).

Receiver side, per source rank, all of that rank's ops become ONE prepared
transfer request: a remote descriptor list (each op's source run inside the
trainer's registered tensor) and a local one (the op's destination run in the
receiver's registered arena, or a scratch slot for strided targets). Requests
are prepared once and re-posted on every warm cycle; nothing is registered or
prepared again until a source re-registers its memory (then only that source's requests:
``RequestBuilder.rebuild``) or the layout changes.

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
from typing import Any

import torch

from megarefit.layout import RankCoord
from megarefit.plan import Plan, TensorRef
from megarefit.transport.cuda_ipc import DeviceCopies, IpcSources
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl_agent import NixlAgent, TransferError, mem_type
from megarefit.transport.quarantine import Quarantine
from megarefit.transport.nixl_requests import (
    DIRECT_MIN_BYTES,
    GAP_BYTES,
    MAX_DIRECT,
    SCRATCH_FRACTION,
    SCRATCH_MIN_BYTES,
    PreparedPlan,
    RequestBuilder,
    Scratch,
    SourcePulls,
    pull_error,
    post_read,
    release_stale,
    release_requests,
)

SCRATCH_THREADS = 4
"""Intra-op threads for the strided scratch copies. Many small strided copies with
all cores' OpenMP threads, next to busy-polling NIXL progress threads, collapse:
measured on a 16-core host (Qwen3-0.6B, 4 trainers) 1.93 s with 16 threads vs
0.024 s with 4 (docs/benchmarks.md)."""

POLITE_POLL_S = 0.0002
"""Seconds between completion polls of a background pull (:meth:`NixlTransport.polite`): a
spinning poll holds the GIL for whole switch intervals (5 ms) against a consumer generating in
the same process; 200 us bounds the added latency per wave."""


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


@dataclass
class InFlight:
    """READs of one prepared plan posted by :meth:`NixlTransport.start`, not yet waited for."""

    prepared: PreparedPlan
    posted: float  # perf_counter seconds when the first READ was posted
    pending: list[tuple[SourcePulls, int]] = field(default_factory=list)  # (source, wave or -1: direct READ)
    queued: list[tuple[SourcePulls, int, Any]] = field(default_factory=list)  # wave to post after its event
    local: tuple[Any, Any] | None = None  # CUDA events around the CUDA IPC copies (start, end)

    @property
    def done(self) -> bool:
        return not self.pending and not self.queued and (self.local is None or self.local[1].query())

    def poll(self, agent: Any) -> list[tuple[SourcePulls, int]]:
        """Check every pending READ on ``agent`` (a NIXL agent) once; keep the unfinished, return
        the landed waves.

        Raises:
            TransferError: a transfer failed or reported ERR."""
        still, landed = [], []
        for pulls, w in self.pending:
            handle = pulls.handle if w < 0 else pulls.waves[w].handle
            try:
                state = agent.check_xfer_state(handle)
            except Exception as exc:
                raise pull_error(pulls, f"transfer failed: {exc!r}") from exc
            if state == "ERR":
                raise pull_error(pulls, "transfer reported ERR")
            if state != "DONE":
                still.append((pulls, w))
            elif w >= 0:
                landed.append((pulls, w))
        self.pending = still
        return landed


def _add_remote(nixl: NixlAgent, rank: RankCoord, name: str, blob: bytes) -> Any:
    """``add_remote_agent(blob)``; a failure (nixl's own error types: UCX could not create an
    endpoint, e.g. the peer's process is gone) as a :class:`TransferError` naming the rank."""
    try:
        return nixl.agent.add_remote_agent(blob)
    except Exception as exc:  # nixl raises its own error types (nixlBackendError, ...)
        with contextlib.suppress(Exception):  # whatever NIXL kept of it: loaded again on the next connect
            nixl.agent.remove_remote_agent(name)
        coord = f"{rank.tp}.{rank.pp}.{rank.ep}" + (f".{rank.copy}" if rank.copy else "")
        raise TransferError(f"trainer rank {coord} as tp.pp.ep (NIXL agent {name!r}): NIXL could not load its "
                            f"metadata ({type(exc).__name__}: {exc}); its process may have died, or its address "
                            "is unreachable from this receiver", rank=tuple(rank)) from exc


class NixlTransport:
    """Executes whole plans over NIXL into preallocated target buffers.

    ``direct_min_bytes`` / ``max_direct`` / ``gap_bytes`` / ``scratch_budget``: see
    :data:`DIRECT_MIN_BYTES`, :data:`MAX_DIRECT`, :data:`GAP_BYTES`, :data:`SCRATCH_FRACTION`
    (``scratch_budget=None``: the default budget). ``ipc``: ranks it opens are read through
    CUDA IPC instead (:mod:`~megarefit.transport.cuda_ipc`); ``None``: every rank over NIXL.
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = False,
                 direct_min_bytes: int = DIRECT_MIN_BYTES, gap_bytes: int = GAP_BYTES,
                 scratch_budget: int | None = None, max_direct: int = MAX_DIRECT, ipc: IpcSources | None = None,
                 device: torch.device | None = None):
        # The receiver drives progress itself while it polls for completion; a
        # progress thread would only busy-poll a core (inside a vLLM worker, one
        # taken from inference). Publishers keep theirs: peers need it to connect.
        self.nixl = NixlAgent(name, backends=backends, progress_thread=progress_thread, device=device)
        self.direct_min_bytes, self.gap_bytes, self.scratch_budget = direct_min_bytes, gap_bytes, scratch_budget
        self.max_direct = max_direct
        self.ipc = ipc
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata loaded
        self._prepared: dict[tuple[str, ...], list[PreparedPlan]] = {}  # one prepared set at a time
        self._scratch_memory = Scratch(self.nixl)
        self._builder = RequestBuilder(self.nixl, self._scratch_memory, self, self._remote_name)
        self._blocks: dict[tuple, tuple[Any, ...]] = {}  # read_blocks: (agent, addr, nbytes, local) -> request
        self.last_seconds: dict[str, float] = {}
        self.poll_sleep = 0.0  # seconds slept between completion polls (0: spin; see polite())
        self.late = ""  # READs that timed out still land in the buffers: why this transport pulls no more
        self._late: list[Any] | None = []  # their handles; None: READs into memory a quarantine cannot hold
        self.quarantined = Quarantine(self.nixl)  # memory late READs may still write (quarantine.py)

    @property
    def counters(self) -> Counter[str]:
        return self.nixl.counters

    @contextlib.contextmanager
    def polite(self, sleep: float = POLITE_POLL_S) -> Iterator[None]:
        """Inside the block, waits for READs sleep ``sleep`` seconds between completion polls
        instead of spinning (a background pull, e.g. a prefetch beside a consumer generating in
        the same process, then leaves it the GIL and the core). Restored after."""
        before, self.poll_sleep = self.poll_sleep, sleep
        try:
            yield
        finally:
            self.poll_sleep = before

    @property
    def scratch_allocated(self) -> int:
        """Bytes of scratch allocated (and registered) for gathered pulls; it only grows."""
        return self._scratch_memory.allocated

    @property
    def rank_prepares(self) -> Counter[RankCoord]:
        """Per trainer rank, how many times its READ requests were prepared (once per plan each time)."""
        return self._builder.rank_prepares

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
            TransferError: metadata names another agent than the manifest; or NIXL cannot load it
                (no listener: the trainer died first), ``rank`` set: the receiver fails over.
            IpcError: ``transport="ipc"`` and a rank cannot be read through CUDA IPC.
        """
        if self.ipc is not None and self.ipc.connect(manifests):
            self._release_prepared()  # requests and copies against the old mappings
        local = self._ipc_ranks()
        for rank, blob in metadata.items():
            name = manifests[rank].agent
            if rank in local or not blob or self._remotes.get(name) == blob:
                continue
            if name in self._remotes:  # only its requests go (prepare_groups makes them again)
                release_stale(p for group in self._prepared.values() for plan in group for p in plan.per_source
                              if p.agent == name)
                release_requests((), [self._blocks.pop(k) for k in [k for k in self._blocks if k[0] == name]])
                self.nixl.agent.remove_remote_agent(name)
                del self._remotes[name]
            added = _add_remote(self.nixl, rank, name, blob)
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise TransferError(f"rank {rank}: NIXL metadata names agent {added!r}, manifest says {name!r}")
            self._remotes[name] = blob
            self.nixl.counters["remote_agents"] += 1

    def release_scratch(self) -> int:
        """Drop every prepared request and free the scratch (deregistered first; refused while READs
        are late, :func:`refuse_late`); bytes freed. The next :meth:`prepare` allocates it again."""
        refuse_late(self.late)
        self._release_prepared()
        return self._scratch_memory.release()

    def _ipc_ranks(self) -> frozenset[RankCoord]:
        return frozenset() if self.ipc is None else self.ipc.ranks

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Drop every prepared request and deregister ``tensors`` (registered together by one
        :meth:`NixlAgent.register`; refused while READs are late), before the caller frees them."""
        refuse_late(self.late)
        self._release_prepared()
        self.nixl.deregister(tensors)

    def _release_prepared(self) -> None:
        release_requests((p for group in self._prepared.values() for p in group), self._blocks.values())
        self._prepared, self._blocks = {}, {}
        if not self.late:  # an outgrown scratch: no request on it now (late READs: quarantine() takes it)
            self._scratch_memory.drop_retired()

    def read_blocks(self, reads: Sequence[tuple[Manifest, tuple[int, int, str, int], torch.Tensor]], *,
                    timeout: float = 60.0) -> None:
        """READ whole registered blocks of sources (``(manifest, (addr, nbytes, mem, dev),
        local)``: ``nbytes`` from ``addr`` of the manifest's agent into the contiguous
        ``local``, registered here once), all posted at once; requests prepared once.

        Raises:
            TransferError: as :meth:`execute`."""
        agent, posted = self.nixl.agent, []
        refuse_late(self.late)
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
            pulls = SourcePulls(manifest.rank, key[0], [], self._blocks[key][0])
            post_read(self.nixl, pulls, pulls.handle)
            posted.append((pulls, -1))
        wait_posted(self, posted, timeout)

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
        if cached is not None and not any(p.stale for plan in cached for p in plan.per_source):
            return cached  # (a source that re-registered at the same addresses left its requests stale)
        local = self._ipc_ranks() & manifests.keys()
        remote = {r: m for r, m in manifests.items() if r not in local}
        every = [t for b in buffers for t in b.values()]
        if remote:
            self.nixl.register(every)
        old = next(iter(self._prepared.values()), None)  # a declared move: only the moved ranks' again
        if old is not None and self._builder.rebuild(key, old, plans, buffers, manifests, local, every):
            self._prepared = {key: old}
            return old
        out = self._builder.build(key, plans, buffers, manifests, remote, local, every)
        if local:
            assert self.ipc is not None
            for prepared, plan, bufs in zip(out, plans, buffers):
                ops = [op for op in plan.ops if op.src.rank in local]
                prepared.local = DeviceCopies.build(plan, ops, self.ipc.tensor, bufs) if ops else None
        self._release_prepared()  # keep only the current layout's requests
        self._prepared = {key: out}
        return out

    def execute(self, prepared: PreparedPlan, buffers: Mapping[TensorRef, torch.Tensor], *,
                timeout: float = 60.0, grace: float = 60.0) -> None:
        """Post every source's direct READ and first two waves, and wait (:meth:`start`, then
        :meth:`wait`): each wave placed (one batched copy) as soon as it lands, the wave after
        next reusing its scratch half once that placement has finished, beside the other READs.

        Raises:
            TransferError: a peer disconnected, a transfer failed, or ``timeout`` seconds passed
                (names the peer, its first tensors and byte ranges; ``grace``: :meth:`wait`)."""
        self.wait(self.start(prepared, timeout=timeout), timeout=timeout, grace=grace)

    def start(self, prepared: PreparedPlan, *, timeout: float = 60.0) -> InFlight:
        """Post every source's direct READ and its first two waves; return without waiting.
        The READs move while the caller does other work (a streamed receiver hands the
        previous group over meanwhile); :meth:`wait` places the waves and finishes. Nothing
        else may use the scratch until then.

        Raises:
            TransferError: a READ could not be posted (names the peer and its first tensors); those
                posted before are waited for first (up to ``timeout`` s); :attr:`late` set: at once."""
        refuse_late(self.late)
        flight = InFlight(prepared, time.perf_counter())
        try:
            _post_first(self.nixl, flight)
        except TransferError:
            drain(self.nixl.agent, flight, time.monotonic() + timeout, self.poll_sleep)
            raise
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

    def wait(self, flight: InFlight, *, timeout: float = 60.0, grace: float = 60.0) -> None:
        """Finish a :meth:`start`: place each wave as it lands, post the later waves as
        scratch halves free up, until every READ is done; ``last_seconds``: ``read`` (from
        post to done, less placements) and ``scratch`` (placements) seconds.

        Raises:
            TransferError: a transfer failed, or ``timeout`` s passed; the READs in flight are
                waited for first, up to ``grace`` s more (:func:`settle`: a released READ lands later)."""
        deadline = time.monotonic() + timeout
        try:
            self._wait(flight, deadline, timeout)
        except TransferError as exc:
            flight.queued = []
            self.late = settle(self.nixl.agent, flight, exc, max(deadline, time.monotonic() + grace), self.poll_sleep)
            if self.late and self._late is not None:
                self._late += [p.handle if w < 0 else p.waves[w].handle for p, w in flight.pending]
            raise

    def _wait(self, flight: InFlight, deadline: float, timeout: float) -> None:
        scratch_s = 0.0
        gpu: torch.device | None = None  # the device of the fused placements, if any
        while flight.pending or flight.queued:
            landed = flight.poll(self.nixl.agent)
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
                    post_read(self.nixl, pulls, pulls.waves[w].handle)
                    flight.pending.append((pulls, w))
                else:
                    waiting.append((pulls, w, event))
            flight.queued = waiting
            if (flight.pending or flight.queued) and self.poll_sleep and not landed:
                time.sleep(self.poll_sleep)
            if (flight.pending or flight.queued) and time.monotonic() > deadline:
                who = flight.pending[0][0] if flight.pending else flight.queued[0][0]
                raise pull_error(who, f"no completion after {timeout:.1f} s")
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

    def _remote_name(self, manifest: Manifest) -> str:
        if manifest.agent not in self._remotes:
            raise TransferError(f"rank {manifest.rank}: NIXL agent {manifest.agent!r} was never connected")
        return manifest.agent


def _post_first(nixl: NixlAgent, flight: InFlight) -> None:
    """Post every source's direct READ and its first two waves, each recorded in ``flight`` once posted."""
    for pulls in flight.prepared.per_source:
        if pulls.handle is not None:
            post_read(nixl, pulls, pulls.handle)
            flight.pending.append((pulls, -1))
        for w in range(min(2, len(pulls.waves))):
            post_read(nixl, pulls, pulls.waves[w].handle)
            flight.pending.append((pulls, w))


def drain(agent: Any, flight: InFlight, deadline: float, poll_sleep: float) -> None:
    """Wait until no READ of ``flight`` is in flight on ``agent`` (done, failed, or ``deadline``
    passed): after a failed READ, the others must not land in buffers a retry frees or reuses."""
    while flight.pending and time.monotonic() < deadline:
        still = []
        for pulls, w in flight.pending:
            handle = pulls.handle if w < 0 else pulls.waves[w].handle
            try:
                state = agent.check_xfer_state(handle)
            except Exception:  # noqa: BLE001 -- this one failed: nothing more lands from it
                continue
            if state not in ("DONE", "ERR"):
                still.append((pulls, w))
        flight.pending = still
        if still:
            time.sleep(poll_sleep or 0.001)


def quarantine(transport: NixlTransport, memory: Sequence[torch.Tensor],
               keep: Sequence[torch.Tensor] = ()) -> int | None:
    """After a pull whose READs are still in flight (``transport.late``): hold ``memory``
    (registered by one call), the scratch and the prepared requests until they end
    (:class:`~megarefit.transport.quarantine.Quarantine`); the transport then pulls again, into
    fresh memory only. Returns the bytes held; ``None`` (``late`` stays) where nothing is late or
    late READs write other memory (a delta's or the checksums' buffers). ``keep``: memory held alive
    too, not deregistered (a registration covering it belongs to other memory)."""
    if not transport.late or not transport._late:
        return None
    scratch = transport._scratch_memory.take()  # the current and any outgrown one: each its own registration
    held = transport.quarantined.hold(transport._late, [memory, *[[t] for t in scratch]],
                                      [p for group in transport._prepared.values() for p in group],
                                      list(transport._blocks.values()), transport.late, keep)
    transport._prepared, transport._blocks, transport._late, transport.late = {}, {}, [], ""
    transport.nixl.counters["quarantined_bytes"] += held
    return held


def refuse_late(late: str) -> None:
    """Raise TransferError(``late``) where READs that timed out still land in the buffers (nothing
    may be freed, allocated again or pulled through that transport)."""
    if late:
        raise TransferError(late)


def settle(agent: Any, flight: InFlight, exc: TransferError, deadline: float, poll_sleep: float) -> str:
    """After ``exc`` failed a wait: wait until no READ of ``flight`` is in flight (until
    ``deadline``); ``""`` then, else why the transport must pull nothing more -- a READ still in
    flight writes its buffers later, and a retry, failover or next cycle reuses them."""
    drain(agent, flight, deadline, poll_sleep)
    if not flight.pending:
        return ""
    ranks = sorted({str(tuple(pulls.rank)) for pulls, _ in flight.pending})
    return (f"READs from trainer ranks {', '.join(ranks)} are still in flight after timing out ({exc}): their "
            "bytes may still land in this receiver's buffers, so it pulls nothing more; close it and start a new "
            "receiver process (or give the READs more time: transfer_timeout / timeout)")


def wait_posted(transport: NixlTransport, posted: list[tuple[SourcePulls, int]], timeout: float,
                grace: float = 60.0) -> None:
    """Wait for READs posted outside a prepared plan (raises TransferError as
    :meth:`NixlTransport.wait`; late READs into memory a quarantine cannot take: refused after)."""
    flight = InFlight(PreparedPlan((), []), time.perf_counter(), posted)
    deadline = time.monotonic() + timeout
    while flight.pending:
        flight.poll(transport.nixl.agent)
        if flight.pending and transport.poll_sleep:
            time.sleep(transport.poll_sleep)
        if flight.pending and time.monotonic() > deadline:
            exc = pull_error(flight.pending[0][0], f"no completion after {timeout:.1f} s")
            transport.late = settle(transport.nixl.agent, flight, exc, time.monotonic() + grace, transport.poll_sleep)
            transport._late = None if transport.late else transport._late  # delta / checksum memory: not held
            raise exc


def read_ranges(transport: NixlTransport, reads: Sequence[tuple[Manifest, Sequence[tuple[int, int, int, str, int]]]],
                local: torch.Tensor, *, timeout: float = 60.0) -> int:
    """READ byte ranges of sources into ``local`` (contiguous, registered here once) over
    ``transport``'s agent:
    ``reads`` holds per source ``(manifest, [(remote addr, bytes, local byte offset, NIXL
    memory type, device)])``; one request per source and memory type, made for this call and
    released after it (the ranges of a delta refit change every cycle). Returns the bytes read.

    Raises:
        TransferError: as :meth:`NixlTransport.execute`."""
    refuse_late(transport.late)
    transport.nixl.register([local])
    lmem, ldev = mem_type(local)
    agent, base = transport.nixl.agent, local.data_ptr()
    handles, posted, total = [], [], 0
    try:
        for manifest, ranges in reads:
            name = transport._remote_name(manifest)
            by: dict[tuple[str, int], list[tuple[int, int, int, str, int]]] = {}
            for r in ranges:
                by.setdefault((r[3], r[4]), []).append(r)
            for (mem, dev), rs in by.items():
                handle = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs([(base + off, n, ldev) for _, n, off, _, _ in rs], lmem),
                    agent.get_xfer_descs([(addr, n, dev) for addr, n, _, _, _ in rs], mem), name)
                handles.append(handle)
                pulls = SourcePulls(manifest.rank, name, [], handle)
                post_read(transport.nixl, pulls, handle)
                posted.append((pulls, -1))
                total += sum(n for _, n, _, _, _ in rs)
        wait_posted(transport, posted, timeout)
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)
    return total


__all__ = ["DIRECT_MIN_BYTES", "GAP_BYTES", "MAX_DIRECT", "SCRATCH_FRACTION", "SCRATCH_MIN_BYTES", "SCRATCH_THREADS",
           "InFlight", "NixlTransport", "PreparedPlan", "read_ranges"]
