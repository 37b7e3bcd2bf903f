"""The receiver side of delta refits: read the trainers' delta records, choose per tensor
between the delta and a full read, pull, and scatter into an arena holding the older version.

A staged receiver whose arena holds version ``p`` whole (the last cycle completed and was
fenced) and is asked for ``v > p`` follows each rank's records back from ``v`` to ``p``
(:mod:`~megarefit.online.delta.records`; at most the ``keep`` versions a trainer keeps)::

    records   every rank's chain v -> ... -> p, or the reason there is none (a version no longer
              kept, a version too large for its slot, a new layout): then the cycle is a full one
    choose    per source tensor the plan reads: the seconds to read its segments and place each
              changed element, against the seconds to read the tensor whole -- the cheaper is read;
              the rates are the receiver's own: its reads as measured, its scatter measured once
    pull      one NIXL READ per rank of byte ranges (segments, whole tensors) into one registered
              buffer on the receiver's device
    apply     per tensor, in version order: decode indices (or bitmap), map each source element
              through the plan's copy ops to its target element (:func:`map_through`), scatter
              the values; where the ops are contiguous runs into one arena, on a GPU, one fused
              launch per segment does it all (:mod:`~megarefit.online.delta.kernel`); a tensor
              read whole is placed by the ops themselves

The same bits land as a full pull would place (elements compare and move as integers of their
width). Tensors a receiver-side step produces (FP8 blocks quantized on the receiver, value
steps) have no trainer bytes to patch: a plan with such steps refits in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megarefit.layout import RankCoord
from megarefit.online.delta.held import HeldFingerprint, written
from megarefit.online.delta.kernel import MAX_RUNS, fused, place, warm_up
from megarefit.online.delta.log import BITS
from megarefit.online.delta.records import (
    INDICES,
    PAGE,
    PAGED,
    DeltaRecord,
    DeltaRecordError,
    DeltaSegment,
    decode_record,
    delta_key,
    epoch_key,
    mask_bytes,
    segment_bytes,
)
from megarefit.online.store.kv import StoreError
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.plan.ops import squeezed_lengths
from megarefit.transport.execute import torch_dtype
from megarefit.transport.local import op_views
from megarefit.transport.manifest import Manifest, TensorEntry
from megarefit.transport.nixl import NixlTransport, read_ranges

# The wire rate the cost model starts from (bytes read per second), until the receiver measured its
# own on a cycle: a changed element costs wire / scatter bytes more (scatter: measure_scatter).
START_WIRE = {"cpu": 5e9, "cuda": 5e10}


def measure_scatter(device: torch.device, numel: int = 1 << 25, changed: int | None = None) -> tuple[float, float]:
    """Changed elements placed per second on ``device`` and the fixed seconds of one placing:
    the best of three timed scatters of ``changed`` (default 2**20 on a CPU, 2**24 on a GPU;
    then 16) sorted random elements (16-bit) into a buffer of ``numel``, with the index
    arithmetic of :func:`map_through` (a box's coordinates in and out)."""
    changed = changed or (1 << 24 if device.type == "cuda" else 1 << 20)
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(numel, (changed,), generator=g).sort().values.to(device)
    values = torch.ones(changed, dtype=torch.int16, device=device)
    buf = torch.zeros(numel, dtype=torch.int16, device=device)
    shape = (numel // 4096, 4096)

    def best(n: int) -> float:
        out = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            buf[_ravel(_unravel(idx[:n], shape), shape)] = values[:n]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out = min(out, time.perf_counter() - t0)
        return out

    return changed / best(changed), best(16)


def measure_copy(device: torch.device, numel: int = 1 << 25) -> float:
    """Bytes per second one device copy moves on ``device`` (the best of three copies of
    ``numel`` 16-bit elements): what placing a tensor a delta reads whole costs."""
    src = torch.ones(numel, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * numel / max(best, 1e-9)


def _unravel(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Row-major coordinates ``[n, len(shape)]`` of flat indices ``x`` in ``shape``."""
    out = torch.empty((x.numel(), len(shape)), dtype=torch.int64, device=x.device)
    for d in range(len(shape) - 1, -1, -1):
        out[:, d] = x % shape[d]
        x = x // shape[d]
    return out


def _ravel(c: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Flat row-major indices of coordinates ``c`` ``[n, len(shape)]`` in ``shape``."""
    x = torch.zeros(c.shape[0], dtype=torch.int64, device=c.device)
    for d, n in enumerate(shape):
        x = x * n + c[:, d]
    return x


def _relative(idx: torch.Tensor, shape: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
    """Row-major coordinates of flat indices ``idx`` in ``shape``, less ``offsets``: ``[n, dims]``."""
    out = torch.empty((idx.numel(), len(shape)), dtype=torch.int64, device=idx.device)
    x = idx
    for d in range(len(shape) - 1, -1, -1):
        out[:, d] = x % shape[d] - offsets[d]
        x = x // shape[d]
    return out


def map_through(op: CopyOp, src_shape: Sequence[int], dst_shape: Sequence[int], idx: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``op`` places source elements ``idx`` (flat, ascending, int64): the positions in
    ``idx`` of those inside ``op.src_box`` and their flat indices in the target. ``src_shape`` /
    ``dst_shape``: the op's view of each tensor (``src_view`` / ``dst_view``, else its shape).
    Follows :func:`~megarefit.transport.local.op_views`: row-major order kept across boxes whose
    lengths differ in 1-dims, a transposed op's squeezed matrix transposed. An op reading its
    whole source costs no host synchronization."""
    box = op.src_box
    whole = tuple(box.lengths) == tuple(src_shape)
    if whole:
        sub, pos = idx, torch.arange(idx.numel(), device=idx.device)
    else:
        last = sum(o * s for o, s in zip((o + n - 1 for o, n in zip(box.offsets, box.lengths)),
                                         _strides(src_shape)))
        a, b = torch.searchsorted(idx, torch.tensor([op.src_offset, last + 1], device=idx.device)).tolist()
        sub, pos = idx[a:b], torch.arange(a, b, device=idx.device)
    if op.kind == "contiguous" and not op.transpose:
        return pos, sub - op.src_offset + op.dst_offset
    rel = _relative(sub, src_shape, box.offsets)
    if not whole:
        inside = torch.ones(sub.numel(), dtype=torch.bool, device=idx.device)
        for d, n in enumerate(box.lengths):
            inside &= (rel[:, d] >= 0) & (rel[:, d] < n)
        rel, pos = rel[inside], pos[inside]
    k = _ravel(rel, box.lengths)
    if op.transpose:
        rows, cols = squeezed_lengths(box.lengths, 2)
        k = (k % cols) * rows + k // cols
    dst = _relative(k, op.dst_box.lengths, [-o for o in op.dst_box.offsets])
    return pos, _ravel(dst, dst_shape)


def _strides(shape: Sequence[int]) -> list[int]:
    out, n = [], 1
    for s in reversed(shape):
        out.append(n)
        n *= s
    return out[::-1]


def segment_parts(raw: torch.Tensor, seg: DeltaSegment, entry: TensorEntry, itemsize: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An :data:`INDICES` or :data:`PAGED` segment's parts as views of ``raw``: the names (int32
    indices, or int16 offsets within pages), the int32 changed counts per page (``None`` for
    indices) and the values (integers of ``itemsize`` bytes)."""
    numel = entry.nbytes // itemsize
    mask = mask_bytes(seg.format, seg.count, numel)
    at = (mask + 7) // 8 * 8
    values = raw[at:at + seg.count * itemsize].view(BITS[itemsize])
    if seg.format == INDICES:
        return raw[:mask].view(torch.int32), None, values
    pages = (numel + PAGE - 1) // PAGE
    return raw[4 * pages:mask].view(torch.int16), raw[:4 * pages].view(torch.int32), values


def segment_elements(raw: torch.Tensor, seg: DeltaSegment, entry: TensorEntry, itemsize: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed flat indices (int64, ascending) and values (integers of ``itemsize`` bytes)
    of one segment's bytes ``raw`` (uint8; :mod:`~megarefit.online.delta.records` formats)."""
    numel = entry.nbytes // itemsize
    mask = mask_bytes(seg.format, seg.count, numel)
    if seg.format == INDICES:
        idx = raw[:mask].view(torch.int32).to(torch.int64)
    elif seg.format == PAGED:
        pages = (numel + PAGE - 1) // PAGE
        counts = raw[:4 * pages].view(torch.int32).to(torch.int64)
        page = torch.repeat_interleave(torch.arange(pages, device=raw.device), counts, output_size=seg.count)
        idx = page * PAGE + (raw[4 * pages:mask].view(torch.int16).to(torch.int64) % PAGE)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
        bits = ((raw[:mask].unsqueeze(1) >> shifts) & 1).view(-1)[:numel]
        idx = torch.nonzero_static(bits, size=seg.count).view(-1)  # the count is known: no host sync
    at = (mask + 7) // 8 * 8
    return idx, raw[at:at + seg.count * itemsize].view(BITS[itemsize])


@dataclass
class DeltaChoice:
    """One cycle's delta: per rank the chain of records (oldest first), and per source tensor
    whether it is patched (``delta``) or read whole (``full``); ``reads`` per rank: byte ranges
    ``(remote addr, nbytes, local offset, NIXL memory type, device)``; ``local``: where each
    segment (by tensor, version, entry; version -1: the whole tensor) lands in the local
    buffer; the bytes read, the changed elements read (``changed``, of the patched tensors) and
    of every tensor the plan reads (``all_changed``), and the bytes of the tensors read whole
    (``whole_bytes``: they are placed by a copy after the read)."""

    chains: dict[RankCoord, list[DeltaRecord]]
    delta: dict[TensorRef, list[tuple[DeltaRecord, DeltaSegment]]] = field(default_factory=dict)
    full: dict[TensorRef, TensorEntry] = field(default_factory=dict)
    reads: dict[RankCoord, list[tuple[int, int, int, str, int]]] = field(default_factory=dict)
    local: dict[tuple[TensorRef, int, int], int] = field(default_factory=dict)  # (tensor, version, entry) -> offset
    nbytes: int = 0
    changed: int = 0
    all_changed: int = 0
    whole_bytes: int = 0

    @property
    def base(self) -> int:
        """The version the delta starts from."""
        return min(c[0].base for c in self.chains.values() if c)


def read_epochs(rendezvous: Rendezvous, ranks: Sequence[RankCoord]) -> dict[RankCoord, str] | None:
    """Every rank's delta epoch (:func:`~megarefit.online.delta.records.epoch_key`), read without
    waiting, or ``None`` when a rank publishes no deltas."""
    keys = [epoch_key(r) for r in ranks]
    try:
        return {r: e.decode() for r, e in zip(ranks, rendezvous.fetch_many(keys, timeout=0))}
    except StoreError:
        return None


def fetch_chains(rendezvous: Rendezvous, epochs: Mapping[RankCoord, str], base: int, version: int,
                 keep: int = 16) -> dict[RankCoord, list[DeltaRecord]] | str:
    """Every rank's records (of its delta epoch in ``epochs``) from ``base`` to ``version``,
    oldest first, or why there are none (a version whose record is gone: no longer kept, or too
    large for its slot). Reads never wait: a record deleted meanwhile is a reason too."""
    ranks = sorted(epochs)
    chains: dict[RankCoord, list[DeltaRecord]] = {r: [] for r in ranks}
    at = {r: version for r in ranks}
    for _ in range(keep):
        want = [r for r in ranks if at[r] != base]
        if not want:
            return {r: c[::-1] for r, c in chains.items()}
        try:
            payloads = rendezvous.fetch_many([delta_key(r, epochs[r], at[r]) for r in want], timeout=0)
        except StoreError:
            return (f"no delta record for {', '.join(f'{tuple(r)} v{at[r]}' for r in want[:3])}"
                    " (not kept, or larger than its slot)")
        for r, payload in zip(want, payloads):
            rec = decode_record(payload)
            if rec.version != at[r] or rec.base >= rec.version or rec.base < base:
                return f"rank {tuple(r)}: its record of v{at[r]} starts at v{rec.base}, not on the way to v{base}"
            chains[r].append(rec)
            at[r] = rec.base
    return f"more than {keep} versions between v{base} and v{version}"


def _check_segment(seg: DeltaSegment, e: TensorEntry, rank: RankCoord) -> None:
    """A segment must fit its manifest entry.

    Raises:
        DeltaRecordError: it names more elements than the tensor holds, or its size disagrees."""
    item = max(1, e.nbytes // max(1, _numel(e.shape)))
    if seg.count > e.nbytes // item or seg.nbytes != segment_bytes(seg.format, seg.count, e.nbytes // item, item):
        raise DeltaRecordError(f"rank {tuple(rank)}: segment of {e.name} names {seg.count} elements in "
                               f"{seg.nbytes} bytes, which does not fit the tensor's {e.nbytes} bytes")


def choose(plan: Plan, manifests: Mapping[RankCoord, Manifest], chains: dict[RankCoord, list[DeltaRecord]],
           scatter_bytes: float) -> DeltaChoice:
    """Per source tensor of ``plan``: patch it with its segments, or read it whole, whichever
    costs fewer bytes, a changed element costing ``scatter_bytes`` more (the receiver's wire
    rate over its scatter rate); lays out the reads."""
    out = DeltaChoice(chains)
    read = {ref for ref in plan.sources}
    for rank, chain in sorted(chains.items()):
        entries = manifests[rank].tensors
        segs: dict[int, list[tuple[DeltaRecord, DeltaSegment]]] = {}
        for rec in chain:
            for seg in rec.segments:
                if seg.entry >= len(entries):
                    raise DeltaRecordError(f"rank {tuple(rank)}: a segment of v{rec.version} names manifest entry "
                                           f"{seg.entry} of {len(entries)}")
                _check_segment(seg, entries[seg.entry], rank)
                segs.setdefault(seg.entry, []).append((rec, seg))
        ranges = out.reads.setdefault(rank, [])
        for i, pairs in sorted(segs.items()):
            e = entries[i]
            ref = TensorRef(rank, e.name)
            if ref not in read:
                continue
            out.all_changed += sum(s.count for _, s in pairs)
            if sum(s.nbytes + scatter_bytes * s.count for _, s in pairs) < e.nbytes:
                out.delta[ref] = pairs
                for rec, s in pairs:
                    out.local[(ref, rec.version, i)] = out.nbytes
                    ranges.append((rec.addr + s.offset, s.nbytes, out.nbytes, rec.mem, rec.dev))
                    out.nbytes += s.nbytes
                    out.changed += s.count
            else:
                out.full[ref] = e
                out.local[(ref, -1, i)] = out.nbytes
                ranges.append((e.addr, e.nbytes, out.nbytes, e.mem, e.dev))
                out.nbytes += (e.nbytes + 7) // 8 * 8
                out.whole_bytes += e.nbytes
    return out


@dataclass(frozen=True)
class Runs:
    """One source tensor's ops when each is one contiguous run into the same root buffer (an
    arena), sorted by source offset: ``starts`` / ``ends`` (source elements), ``dst`` (the run's
    first element in the root), ``root`` (the root's elements as integers, flat). A changed
    element's run is one ``searchsorted`` away: no per-op work, no host sync but one."""

    starts: torch.Tensor
    ends: torch.Tensor
    dst: torch.Tensor
    root: torch.Tensor
    whole: bool  # the runs cover every source element: no element to leave out
    @classmethod
    def of(cls, ops: Sequence[CopyOp], buffers: Mapping[TensorRef, torch.Tensor], bits: torch.dtype,
           total: int) -> Runs | None:
        """The runs of ``ops`` (reading a source of ``total`` elements), or ``None`` when one is
        strided or transposed, or they write several roots."""
        if not ops or any(op.kind != "contiguous" or op.transpose for op in ops):
            return None
        roots = {id(_root(buffers[op.dst])): _root(buffers[op.dst]) for op in ops}
        if len(roots) != 1:
            return None
        root = next(iter(roots.values()))
        ops = sorted(ops, key=lambda op: op.src_offset)
        if any(a.src_offset + a.numel > b.src_offset for a, b in zip(ops, ops[1:])) or len(ops) > MAX_RUNS:
            return None  # runs that overlap (one source read twice), or too many for the fused search
        base = [buffers[op.dst].storage_offset() - root.storage_offset() + op.dst_offset for op in ops]
        device = root.device
        covered = all(a.src_offset + a.numel == b.src_offset for a, b in zip(ops, ops[1:])) and ops[0].src_offset == 0
        numel = ops[-1].src_offset + ops[-1].numel
        return cls(torch.tensor([op.src_offset for op in ops], device=device),
                   torch.tensor([op.src_offset + op.numel for op in ops], device=device),
                   torch.tensor(base, device=device), root.reshape(-1).view(bits), covered and numel == total)

    def scatter(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Place changed source elements ``idx`` (ascending) with ``values`` through the runs."""
        k = (torch.searchsorted(self.starts, idx, right=True) - 1).clamp_(min=0)
        flat = idx - self.starts[k] + self.dst[k]
        if self.whole:
            self.root[flat] = values
            return
        sel = ((idx >= self.starts[k]) & (idx < self.ends[k])).nonzero().view(-1)
        self.root[flat[sel]] = values[sel]


def _root(t: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor ``t`` is a view of (an arena), or ``t`` itself."""
    return t._base if t._base is not None and t._base.is_contiguous() else t


class DeltaApplier:
    """Applies a :class:`DeltaChoice` to the arena of a staged receiver (see the module
    docstring); remembers, per plan and buffers, the ops reading each source tensor and their
    :class:`Runs` where they are contiguous."""

    def __init__(self) -> None:
        self._ops: dict[str, dict[TensorRef, list[CopyOp]]] = {}
        self._runs: dict[tuple, Runs | None] = {}

    def ops_of(self, plan: Plan) -> dict[TensorRef, list[CopyOp]]:
        if plan.digest not in self._ops:
            by: dict[TensorRef, list[CopyOp]] = {}
            for op in plan.ops:
                by.setdefault(op.src, []).append(op)
            self._ops = {plan.digest: by}
            self._runs = {}
        return self._ops[plan.digest]

    def _runs_of(self, ref: TensorRef, ops: Sequence[CopyOp], buffers: Mapping[TensorRef, torch.Tensor],
                 item: int, total: int) -> Runs | None:
        key = (ref, id(buffers), item)
        if key not in self._runs:
            self._runs[key] = Runs.of(ops, buffers, BITS[item], total)
        return self._runs[key]

    def apply(self, plan: Plan, choice: DeltaChoice, local: torch.Tensor,
              buffers: Mapping[TensorRef, torch.Tensor], manifests: Mapping[RankCoord, Manifest]) -> None:
        """Patch ``buffers`` (the arena's targets) from ``local`` (the bytes read, uint8)."""
        ops = self.ops_of(plan)
        for (ref, version, i), at in sorted(choice.local.items(), key=lambda kv: kv[1]):
            entry = manifests[ref.rank].tensors[i]
            item = entry.nbytes // max(1, _numel(entry.shape))
            if version == -1:
                src = local[at:at + entry.nbytes].view(BITS[item]).view(entry.shape)
                for op in ops.get(ref, ()):
                    dst, part = op_views(op, src, buffers[op.dst].view(BITS[item]))
                    dst.copy_(part)
                continue
            seg = next(s for rec, s in choice.delta[ref] if rec.version == version)
            runs = self._runs_of(ref, ops.get(ref, ()), buffers, item, entry.nbytes // item)
            if runs is not None and fused(runs.root.device) and seg.format in (INDICES, PAGED):
                names, pages, values = segment_parts(local[at:at + seg.nbytes], seg, entry, item)
                place(names, pages, values, runs.starts, runs.ends, runs.dst, runs.root)  # one fused launch
                continue
            idx, values = segment_elements(local[at:at + seg.nbytes], seg, entry, item)
            if runs is not None:
                runs.scatter(idx, values)
                continue
            for op in ops.get(ref, ()):
                src_shape = op.src_view or plan.sources[ref].shape
                dst_shape = op.dst_view or plan.targets[op.dst].shape
                pos, flat = map_through(op, src_shape, dst_shape, idx)
                buffers[op.dst].view(BITS[item]).view(-1)[flat] = values[pos]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def pull_ranges(transport: NixlTransport, manifests: Mapping[RankCoord, Manifest], choice: DeltaChoice,
                local: torch.Tensor, timeout: float) -> int:
    """READ every range of ``choice`` into ``local`` (uint8, registered), one request per rank
    and memory type; the bytes read.

    Raises:
        TransferError: as :func:`~megarefit.transport.nixl.read_ranges`."""
    return read_ranges(transport, [(manifests[r], ranges) for r, ranges in sorted(choice.reads.items()) if ranges],
                       local, timeout=timeout)


class DeltaReceiver:
    """A staged receiver's delta state: the version its arena holds whole (``held``, with the
    plan and trainer memory it was pulled under), the registered local buffer the ranges land
    in, why the last cycle was a full one (``reason``), and the cost model's ``rates``: bytes
    per second read by full pulls and by deltas, each tensor's fixed cost and the last warm full
    pull's seconds (measured on cycles; ``learn = False`` keeps them as set), and changed
    elements placed per second (:func:`measure_scatter`, once). A learning receiver times one
    warm full pull before its first delta; a whole delta expected to take longer than the full
    pull is not used.

    ``held`` is cleared before any pull writes the arena and set again only after a cycle was
    fenced (and its checksums verified), so a failed cycle -- delta or full -- is followed by a
    full one: the arena is never patched from a version it does not hold whole."""

    def __init__(self, transport: NixlTransport, device: torch.device, enabled: bool = True):
        self.transport, self.device, self.enabled = transport, device, enabled
        self.held: tuple[int, tuple, dict | None] | None = None
        self._open = False  # a cycle began (choice) and was not held yet
        self._epochs: dict[RankCoord, str] | None = None  # the trainers' delta epochs read by the last choice
        self.reason = "first cycle" if enabled else "delta=False"
        self._print: HeldFingerprint | None = None  # the held arena's fingerprint (hold)
        self._layout: list[tuple[str, str, int, tuple[int, ...]]] = []
        self.local: torch.Tensor | None = None
        self.applier = DeltaApplier()
        wire = START_WIRE["cuda" if device.type == "cuda" else "cpu"]
        self.rates = {"wire": wire,  # bytes / s a full pull reads
                      "delta_wire": wire,  # bytes / s a delta reads (its slots may be in host memory)
                      "scatter": 0.0,  # changed elements / s placed (0: not yet measured)
                      "copy": 0.0,  # bytes / s a tensor read whole is placed at (0: not yet measured)
                      "tensor": 0.0,  # seconds each tensor of a delta costs besides its elements
                      "full": 0.0}  # seconds the last full pull took (0: none yet)
        self.seconds: dict[str, float] = {}  # the last delta cycle's read and apply
        self.learn = True  # fold each cycle's measured rates into ``rates`` (False: keep them as set)
        if enabled:
            warm_up(device)  # the fused placing compiled off the first delta cycle

    def measured(self, rate: str, amount: float, seconds: float) -> None:
        """Fold a measurement into ``rates`` (half the old, half the new): ``"wire"`` (a full
        pull's) or ``"delta_wire"`` (a delta's), ``amount`` bytes read in ``seconds`` (1 ms or
        more); ``"tensor"``, ``seconds`` per tensor; ``"full"``, the seconds of a warm full pull."""
        if not self.learn:
            return
        if rate in ("wire", "delta_wire") and seconds >= 1e-3 and amount > 0:
            self.rates[rate] = 0.5 * self.rates[rate] + 0.5 * amount / seconds
        elif rate not in ("wire", "delta_wire"):
            self.rates[rate] = seconds if not self.rates[rate] else 0.5 * self.rates[rate] + 0.5 * seconds

    def estimate(self, choice: DeltaChoice) -> float:
        """Seconds the cost model expects ``choice`` to take: its bytes read, its changed
        elements placed, the tensors it reads whole placed by a copy, and each patched tensor's
        fixed cost."""
        if not self.rates["copy"]:
            self.rates["copy"] = measure_copy(self.device)
        return (choice.nbytes / self.rates["delta_wire"] + choice.changed / self.rates["scatter"]
                + choice.whole_bytes / self.rates["copy"] + len(choice.delta) * self.rates["tensor"])

    @property
    def scatter_bytes(self) -> float:
        """What placing one changed element costs, in bytes read (wire rate / scatter rate; the
        scatter rate measured once, by :func:`measure_scatter`, unless set)."""
        if not self.rates["scatter"]:
            self.rates["scatter"], fixed = measure_scatter(self.device)
            self.rates["tensor"] = self.rates["tensor"] or 4 * fixed  # decode + a few ops, until measured
        return self.rates["wire"] / self.rates["scatter"]

    @staticmethod
    def key(plan: Plan, manifests: Mapping[RankCoord, Manifest]) -> tuple:
        return plan.digest, tuple(sorted((r, m.entries_digest) for r, m in manifests.items()))  # (a move: the same)

    @property
    def local_bytes(self) -> int:
        """Bytes of the local buffer the ranges land in (0 before the first delta cycle)."""
        return 0 if self.local is None else self.local.numel()

    def forget(self, reason: str) -> None:
        """The arena no longer holds a version whole (``reason`` says why, in stats); the cached
        runs (views of that arena) and the landing buffer are let go."""
        self.held, self._open, self._print = None, False, None
        self.applier = DeltaApplier()
        if self.local is not None:
            self.transport.nixl.deregister([self.local])
            self.local = None
        if self.enabled:
            self.reason = reason

    def hold(self, version: int, plan: Plan, manifests: Mapping[RankCoord, Manifest],
             arenas: Mapping[str, torch.Tensor] | None = None,
             layout: list[tuple[str, str, int, tuple[int, ...]]] | None = None) -> None:
        """The arena holds ``version`` whole (the cycle was fenced), as of the trainers' delta
        epochs read when the cycle began. ``arenas`` (per dtype, their targets' ``layout``):
        fingerprinted now (:mod:`~megarefit.online.delta.held`) where the trainers publish deltas, so
        that a later delta first checks nobody wrote them; ``None`` (a streamed receiver's direct
        targets): not checked."""
        self.held = (version, self.key(plan, manifests), self._epochs)
        self._open = False
        t0 = time.perf_counter()
        deltas = self.enabled and self._epochs is not None  # (trainers that publish none: no delta comes next)
        self._print = HeldFingerprint(arenas) if arenas is not None and deltas else None
        self._layout = layout or []
        if self._print is not None:
            self.seconds["held.fingerprint"] = time.perf_counter() - t0

    def _written(self, base: int) -> str:
        """Why the arena no longer holds ``base`` (its bytes changed since it was fenced), or ``""``."""
        if self._print is None:
            return ""
        t0 = time.perf_counter()
        changed = self._print.changed()
        self.seconds["held.check"] = time.perf_counter() - t0
        if not changed:
            return ""
        names = written(changed, self._layout, {d: torch_dtype(d).itemsize for d in self._print.arenas})
        return (f"the arena no longer holds v{base} as fenced: bytes of {len(names)} handed-over tensor(s) changed "
                f"since ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; the 32 KiB chunks that differ). "
                "The tensors a staged cycle yields are the receiver's own memory: read or copy them, never write "
                "them")

    def choice(self, rendezvous: Rendezvous, plan: Plan, manifests: Mapping[RankCoord, Manifest],
               ranks: Sequence[RankCoord], version: int) -> DeltaChoice | str:
        """The delta from the held version to ``version``, or why the cycle pulls in full;
        clears ``held`` either way (the arena is about to be written)."""
        held, self.held = self.held, None
        self.seconds = {}
        if not self.enabled:
            return self.reason
        if self._open:  # the last cycle began and was never held: it failed
            self.reason = "the previous cycle did not complete"
        self._open = True  # until this one completes (hold)
        self._epochs = read_epochs(rendezvous, ranks)  # before the bytes: what a held version belongs to
        if held is None:
            return self.reason
        base, key, epochs = held
        why = self._refused(plan, manifests, base, version, key)
        if why:
            return why
        if self._epochs is None or epochs != self._epochs:
            return ("trainer ranks publish no deltas (Publisher(delta=True))" if self._epochs is None
                    else "a trainer rank started anew since the version held (its delta epoch changed)")
        if self.learn and not self.rates["full"]:
            return "no warm full pull timed yet (the cost model's baseline)"
        try:
            chains = fetch_chains(rendezvous, self._epochs, base, version)
            if isinstance(chains, str):
                return chains
            written = self._written(base)  # (the last check before the choice: it reads the whole arena)
            if written:
                return written
            choice = choose(plan, manifests, chains, self.scatter_bytes)
        except DeltaRecordError as exc:
            return f"a delta record was refused: {exc}"
        return self._worth(plan, choice)

    def _worth(self, plan: Plan, choice: DeltaChoice) -> DeltaChoice | str:
        """``choice``, or why a full pull is better: no tensor is worth patching, or the whole
        delta is expected to take longer than the full pull."""
        if not choice.delta:
            return (f"no tensor is cheaper to patch than to read whole ({choice.all_changed} changed elements in "
                    f"{len(choice.full)} tensors, {self.rates['scatter']:.3g} placed per second here): a full pull")
        full = self.rates["full"] or plan.nbytes / self.rates["wire"]
        if self.estimate(choice) >= full:
            return (f"the delta ({choice.nbytes} bytes, {choice.changed} of {choice.all_changed} changed elements "
                    f"patched, {len(choice.full)} tensors read whole, about {self.estimate(choice) * 1e3:.1f} ms) "
                    f"costs more than a full pull ({plan.nbytes} bytes, {full * 1e3:.1f} ms) at the measured rates")
        return choice

    def _refused(self, plan: Plan, manifests: Mapping[RankCoord, Manifest], base: int, version: int,
                 key: tuple) -> str:
        if key != self.key(plan, manifests):
            return "the plan or a trainer rank's served tensors changed"
        if version <= base:
            return f"v{version} asked while the arena holds v{base}"
        if plan.quantize or plan.transforms:
            return "the plan has receiver-side steps (FP8 blocks quantized here, value steps)"
        if self.transport.ipc is not None and self.transport.ipc.ranks:
            return "trainer ranks are read through CUDA IPC"
        return ""

    def pull(self, plan: Plan, choice: DeltaChoice, buffers: Mapping[TensorRef, torch.Tensor],
             manifests: Mapping[RankCoord, Manifest], timeout: float, stable: Callable[[], None],
             landing: torch.Tensor | None = None) -> int:
        """READ ``choice``'s ranges, call ``stable`` (the fence's end check: it raises when a
        rank wrote meanwhile, so a torn read is never decoded), then patch ``buffers``; the
        bytes read. ``landing``: registered uint8 memory of at least ``choice.nbytes`` bytes the
        ranges land in (a streamed receiver's ring), else the receiver's own buffer.

        Raises:
            TransferError: as :func:`pull_ranges`; and what ``stable`` raises."""
        need = max(8, choice.nbytes)
        if landing is None or landing.numel() < need:
            if self.local is None or self.local.numel() < need:
                if self.local is not None:
                    self.transport.nixl.deregister([self.local])
                self.local = torch.empty(need + need // 4, dtype=torch.uint8, device=self.device)
            landing = self.local
        t0 = time.perf_counter()
        read = pull_ranges(self.transport, manifests, choice, landing, timeout)
        stable()
        t1 = time.perf_counter()
        self.applier.apply(plan, choice, landing, buffers, manifests)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.measured("delta_wire", read, t1 - t0)
        placing = choice.changed / self.rates["scatter"] + choice.whole_bytes / self.rates["copy"]
        self.measured("tensor", 0, max(0.0, t2 - t1 - placing) / len(choice.delta))  # per patched tensor
        self.seconds.update({"delta.read": t1 - t0, "delta.apply": t2 - t1})
        return read


__all__ = ["START_WIRE", "DeltaApplier", "DeltaChoice", "DeltaReceiver", "Runs", "choose", "fetch_chains",
           "map_through", "measure_copy", "measure_scatter", "pull_ranges", "read_epochs", "segment_elements",
           "segment_parts"]
