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

``nixl`` is imported lazily; install the ``nixl`` extra.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.manifest import Manifest
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.local import BOX_WORD, part_views, widened


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


class TransferError(MegarefitError, RuntimeError):
    """A NIXL transfer failed or timed out; names the peer, tensors and byte ranges."""


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MegarefitError("the NIXL transport needs the `nixl` package: pip install 'megarefit[nixl]'") from exc
    return nixl_agent, nixl_agent_config


class NixlAgent:
    """A NIXL agent (UCX backend) with counters for what it registers and prepares.

    ``progress_thread``: NIXL's background progress thread (needed on the serving
    side so peers can connect; it busy-polls a CPU core).

    ``counters`` keys: ``registrations`` (register_memory calls), ``registered_bytes``,
    ``remote_agents`` (add_remote_agent calls), ``dlists`` (prepared descriptor
    lists), ``xfers`` (transfer requests created), ``posts`` (transfers posted).
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = True):
        nixl_agent, nixl_agent_config = _nixl()
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends)))
        self.counters: Counter[str] = Counter()
        self._registered: dict[tuple[int, int], Any] = {}
        self._starts: list[tuple[int, int]] = []  # sorted (start, length) of the registrations

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register tensors' memory once (already-registered regions are skipped).

        A view of a larger contiguous tensor (an arena slice, a parameter inside Megatron's
        contiguous parameter buffer) registers that whole tensor once, so runs of
        neighbouring views can travel as one descriptor (:meth:`region`)."""
        roots: dict[tuple[int, int], torch.Tensor] = {}
        for t in tensors:
            if not t.is_contiguous():
                raise MegarefitError(f"cannot register a non-contiguous tensor of shape {tuple(t.shape)}")
            base = t._base if t._base is not None and t._base.is_contiguous() else t
            key = (base.data_ptr(), base.numel() * base.element_size())
            if self.region(t.data_ptr(), t.numel() * t.element_size()) is None:
                roots.setdefault(key, base)
        new = [t for key, t in roots.items() if key not in self._registered]
        if not new:
            return
        handle = self.agent.register_memory(list(new))
        for t in new:
            self._registered[(t.data_ptr(), t.numel() * t.element_size())] = handle
        self.counters["registrations"] += 1
        self.counters["registered_bytes"] += sum(t.numel() * t.element_size() for t in new)

    def region(self, addr: int, nbytes: int) -> int | None:
        """Start address of the registered region holding bytes ``[addr, addr + nbytes)``
        (an id: equal ids mean one region), or ``None``."""
        if len(self._starts) != len(self._registered):
            self._starts = sorted(self._registered)
        i = bisect.bisect_right(self._starts, (addr, float("inf"))) - 1
        while i >= 0:  # regions do not nest in practice; step back past shorter ones just in case
            start, length = self._starts[i]
            if addr + nbytes <= start + length:
                return start
            i -= 1
            if i >= 0 and self._starts[i][0] + self._starts[i][1] <= addr:
                break
        return None

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()


def mem_type(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's bytes: ``("VRAM", cuda index)`` or ``("DRAM", 0)``."""
    if t.is_cuda:
        return "VRAM", t.device.index or 0
    return "DRAM", 0


@dataclass
class _SourcePulls:
    rank: RankCoord
    agent: str
    ops: list[CopyOp]
    handle: Any = None
    descriptors: int = 0
    wire_bytes: int = 0  # bytes the READ moves (scratch runs may hold more than their ops use)
    scratch_runs: list[tuple[TensorRef, int, int]] = field(default_factory=list)  # (source, first, stop) elements
    dlists: tuple[Any, ...] = ()
    # (op, destination view, source view in scratch), built once at prepare time
    scratch_ops: list[tuple[CopyOp, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@dataclass
class _Segment:
    """One scratch pull: elements ``[start, stop)`` of a source tensor's flat storage,
    serving every scratch op whose source box lies inside it."""

    src: TensorRef
    start: int
    stop: int
    ops: list[tuple[CopyOp, tuple[int, ...]]]  # (op, element strides of its source shape)


def _scratch_segments(plan: Plan, ops: Sequence[CopyOp]) -> list[_Segment]:
    """Merge the flat source runs of ``ops`` (scratch ops of one source rank) per tensor."""
    runs: dict[TensorRef, list[tuple[int, int, CopyOp, tuple[int, ...]]]] = {}
    for op in ops:
        strides = _contiguous_strides(op.src_view or plan.sources[op.src].shape)
        last = op.src_offset + sum((n - 1) * st for n, st in zip(op.src_box.lengths, strides))
        runs.setdefault(op.src, []).append((op.src_offset, last + 1, op, strides))
    segments: list[_Segment] = []
    for ref, items in runs.items():
        items.sort(key=lambda r: r[0])
        current: _Segment | None = None
        for start, stop, op, strides in items:
            if current is None or start > current.stop:
                current = _Segment(ref, start, stop, [])
                segments.append(current)
            current.stop = max(current.stop, stop)
            current.ops.append((op, strides))
    return segments


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def _seg_bytes(seg: _Segment, itemsize: Mapping[TensorRef, int]) -> int:
    return (seg.stop - seg.start) * itemsize[seg.src]


def _coalesce(remote: list[tuple[int, int, int]], local: list[tuple[int, int, int]], remote_regions: list[int],
              local_regions: list[int | None]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Join consecutive descriptors whose remote and local runs both continue each other
    inside one registered region on each side (e.g. an expert's gate, up and down pulls
    when the trainer's tensors and the receiver's targets are laid out back to back):
    fewer, larger descriptors, the same bytes. Region ``-1`` / ``None`` (unknown) never joins."""
    out_r: list[tuple[int, int, int]] = []
    out_l: list[tuple[int, int, int]] = []
    last = (-1, None)
    order = sorted(range(len(remote)), key=lambda i: (remote_regions[i], remote[i][0]))  # trainer memory order
    for r, l, rr, lr in ((remote[i], local[i], remote_regions[i], local_regions[i]) for i in order):
        if (out_r and rr >= 0 and lr is not None and (rr, lr) == last and out_r[-1][0] + out_r[-1][1] == r[0]
                and out_l[-1][0] + out_l[-1][1] == l[0]):
            out_r[-1] = (out_r[-1][0], out_r[-1][1] + r[1], r[2])
            out_l[-1] = (out_l[-1][0], out_l[-1][1] + l[1], l[2])
        else:
            out_r.append(r)
            out_l.append(l)
        last = (rr, lr)
    return out_r, out_l


@dataclass
class PreparedPlan:
    """Prepared transfer requests for one plan against one set of source memories."""

    key: tuple[str, ...]
    per_source: list[_SourcePulls]

    @property
    def wire_bytes(self) -> int:
        """Bytes every READ of one cycle moves: each contiguous pull, plus each scratch run
        whole (a strided source box is read as the smallest flat run holding it)."""
        return sum(p.wire_bytes for p in self.per_source)


class NixlTransport:
    """Executes whole plans over NIXL into preallocated target buffers."""

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = False):
        # The receiver drives progress itself while it polls for completion; a
        # progress thread would only busy-poll a core (inside a vLLM worker, one
        # taken from inference). Publishers keep theirs: peers need it to connect.
        self.nixl = NixlAgent(name, backends=backends, progress_thread=progress_thread)
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata loaded
        self._prepared: dict[tuple[str, ...], PreparedPlan] = {}
        self._scratch: torch.Tensor | None = None
        self.last_seconds: dict[str, float] = {}

    @property
    def counters(self) -> Counter[str]:
        return self.nixl.counters

    def connect(self, manifests: Mapping[RankCoord, Manifest], metadata: Mapping[RankCoord, bytes]) -> None:
        """Load each source's NIXL metadata (NIXL's own metadata exchange); once per agent.

        A source that re-registered (e.g. a restarted trainer: same agent name, new
        metadata) replaces its old entry, and requests prepared against it are released.
        """
        for rank, blob in metadata.items():
            name = manifests[rank].agent
            if not blob or self._remotes.get(name) == blob:
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

    def _release_prepared(self) -> None:
        for prepared in self._prepared.values():
            for pulls in prepared.per_source:
                for handle in (pulls.handle, *pulls.dlists):
                    with contextlib.suppress(Exception):
                        handle.release()
        self._prepared = {}

    def prepare(self, plan: Plan, manifests: Mapping[RankCoord, Manifest],
                buffers: Mapping[TensorRef, torch.Tensor]) -> PreparedPlan:
        """Prepare (or fetch from cache) one READ request per source rank for ``plan``.

        ``buffers`` are the targets (contiguous, registered here once). Cached by
        the plan digest and every source's memory digest.
        """
        key = (plan.digest,) + tuple(manifests[r].memory_digest for r in sorted(manifests))
        cached = self._prepared.get(key)
        if cached is not None:
            return cached
        self.nixl.register(list(buffers.values()))
        by_rank: dict[RankCoord, _SourcePulls] = {}
        for op in plan.ops:
            rank = op.src.rank
            assert rank is not None
            pulls = by_rank.get(rank)
            if pulls is None:
                pulls = by_rank[rank] = _SourcePulls(rank, manifests[rank].agent, [])
            pulls.ops.append(op)
        segments = {rank: _scratch_segments(plan, [op for op in pulls.ops if op.kind == "scratch"])
                    for rank, pulls in by_rank.items()}
        itemsize = {op.src: op.itemsize for op in plan.ops}
        scratch_bytes = sum(_align(_seg_bytes(seg, itemsize)) for segs in segments.values() for seg in segs)
        device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
        if scratch_bytes and (self._scratch is None or self._scratch.numel() < scratch_bytes
                              or self._scratch.device != device):
            self._scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)  # beside the buffers
            self.nixl.register([self._scratch])
        prepared = PreparedPlan(key, [])
        scratch_at = 0
        local_mem = {mem_type(t) for t in buffers.values()} | ({mem_type(self._scratch)} if scratch_bytes else set())
        if len(local_mem) > 1:
            raise TransferError(f"receiver buffers span memory types {sorted(local_mem)}; keep them on one device")
        (lmem, ldev), = local_mem or {("DRAM", 0)}
        for rank, pulls in sorted(by_rank.items()):
            entries = manifests[rank].by_name()
            remote_mem = {(entries[op.src.name].mem, entries[op.src.name].dev) for op in pulls.ops}
            if len(remote_mem) > 1:
                raise TransferError(f"trainer rank {rank} serves tensors from several memories {sorted(remote_mem)}; "
                                    "a rank must keep its published tensors on one device")
            (rmem, rdev), = remote_mem
            remote, local, rregions = [], [], []
            for op in pulls.ops:
                if op.kind == "contiguous":
                    remote.append((entries[op.src.name].addr + op.src_byte_offset, op.nbytes, rdev))
                    local.append((buffers[op.dst].data_ptr() + op.dst_byte_offset, op.nbytes, ldev))
                    rregions.append(entries[op.src.name].region)
            # scratch runs in the trainer's memory order; a run that continues the previous one
            # there gets the next bytes here too, so the two travel as one descriptor (_coalesce)
            ordered = sorted(segments[rank], key=lambda g: (entries[g.src.name].region,
                                                            entries[g.src.name].addr + g.start * itemsize[g.src]))
            prev: tuple[int, int] | None = None  # (region, end address) of the previous run
            end = scratch_at  # first byte after the previous slot
            for seg in ordered:
                assert self._scratch is not None
                item, nbytes = itemsize[seg.src], _seg_bytes(seg, itemsize)
                dtype = buffers[seg.ops[0][0].dst].dtype
                entry = entries[seg.src.name]
                addr = entry.addr + seg.start * item
                follows = (entry.region >= 0 and prev == (entry.region, addr)
                           and end % torch.empty((), dtype=dtype).element_size() == 0)
                if follows:
                    scratch_at = end
                slot = self._scratch[scratch_at: scratch_at + nbytes].view(dtype)
                remote.append((addr, nbytes, rdev))
                local.append((slot.data_ptr(), nbytes, ldev))
                rregions.append(entry.region)
                pulls.scratch_runs.append((seg.src, seg.start, seg.stop))
                for op, strides in seg.ops:
                    part = slot[op.src_offset - seg.start:].as_strided(op.src_box.lengths, strides)
                    pulls.scratch_ops.append((op, *widened(*part_views(op, part, buffers[op.dst]), BOX_WORD)))
                prev, end = (entry.region, addr + nbytes), scratch_at + nbytes
                scratch_at += _align(nbytes)  # the next slot starts aligned unless it continues this one
            remote, local = _coalesce(remote, local, rregions, [self.nixl.region(a, n) for a, n, _ in local])
            pulls.descriptors = len(remote)
            pulls.wire_bytes = sum(n for _, n, _ in remote)
            agent = self.nixl.agent
            rh = agent.prep_xfer_dlist(self._remote_name(manifests[rank]), remote, rmem)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, lmem)
            idx = list(range(len(remote)))
            pulls.handle = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
            pulls.dlists = (lh, rh)
            self.nixl.counters["dlists"] += 2
            self.nixl.counters["xfers"] += 1
            prepared.per_source.append(pulls)
        self._release_prepared()  # keep only the current layout's requests
        self._prepared = {key: prepared}
        return prepared

    def _remote_name(self, manifest: Manifest) -> str:
        if manifest.agent not in self._remotes:
            raise TransferError(f"rank {manifest.rank}: NIXL agent {manifest.agent!r} was never connected")
        return manifest.agent

    def execute(self, prepared: PreparedPlan, buffers: Mapping[TensorRef, torch.Tensor], *,
                timeout: float = 60.0) -> None:
        """Post every source's READ and wait; each source's scratch copies run as soon as
        its READ completes (overlapping the other sources' transfers).

        Raises:
            TransferError: a peer disconnected, a transfer failed, or ``timeout``
                seconds passed; the message names the peer, its first tensors
                and byte ranges.
        """
        agent = self.nixl.agent
        t_post = time.perf_counter()
        for pulls in prepared.per_source:
            try:
                agent.transfer(pulls.handle)
            except Exception as exc:  # nixl raises its own error types per failure
                raise TransferError(self._describe(pulls, f"could not post READ: {exc!r}")) from exc
            self.nixl.counters["posts"] += 1
        deadline = time.monotonic() + timeout
        pending = list(prepared.per_source)
        scratch_s = 0.0
        while pending:
            still = []
            for pulls in pending:
                try:
                    state = agent.check_xfer_state(pulls.handle)
                except Exception as exc:
                    raise TransferError(self._describe(pulls, f"transfer failed: {exc!r}")) from exc
                if state == "ERR":
                    raise TransferError(self._describe(pulls, "transfer reported ERR"))
                if state != "DONE":
                    still.append(pulls)
                    continue
                # this source is done: its strided copies overlap the other sources' READs
                t0 = time.perf_counter()
                if pulls.scratch_ops and pulls.scratch_ops[0][1].is_cuda:  # one fused call on a GPU
                    torch._foreach_copy_([d for _, d, _ in pulls.scratch_ops], [s for _, _, s in pulls.scratch_ops])
                else:
                    with _bounded_threads(SCRATCH_THREADS):
                        for _, dst, src in pulls.scratch_ops:
                            dst.copy_(src)
                scratch_s += time.perf_counter() - t0
            pending = still
            if pending and time.monotonic() > deadline:
                raise TransferError(self._describe(pending[0], f"no completion after {timeout:.1f} s"))
        total = time.perf_counter() - t_post
        self.last_seconds = {"read": total - scratch_s, "scratch": scratch_s}

    @staticmethod
    def _describe(pulls: _SourcePulls, what: str) -> str:
        first = ", ".join(f"{op.src.name} bytes [{op.src_byte_offset}, {op.src_byte_offset + op.nbytes})"
                          for op in pulls.ops[:3])
        return (f"READ from peer {pulls.agent!r} (rank {pulls.rank}) of {len(pulls.ops)} ops "
                f"({sum(op.nbytes for op in pulls.ops)} bytes): {what}; first ops: {first}")
