"""A receiver's checksum checks: every pulled box against what its trainer rank published.

``RefitReceiver(verify_checksums=True)`` with ``Publisher(checksums=True)`` trainers: each
cycle READs every rank's checksum block (:mod:`megarefit.transport.checksum`: row and column
sums of each served tensor, rewritten inside the rank's seqlock by every publish; about
``8 * (R + C)`` bytes per ``[R, C]`` matrix) and, on the receiver's device, recomputes the
sums of each op's box from the bytes that landed in the arena or ring, before any of them is
handed over. Legacy GroupedMLP experts are summed per expert
(:func:`~megarefit.transport.checksum.sum_frame`), so every box a plan pulls from them is
one expert's whole rows or columns. A plan with a box no published sum covers is refused before any byte moves
(:class:`~megarefit.transport.checksum.UncheckableBoxError`): no box is left out silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.checksum import (
    ChecksumMismatchError,
    SumFrame,
    UncheckableBoxError,
    box_kind,
    box_sums,
    sum_frame,
)
from megarefit.transport.checksum_kernel import BoxSums
from megarefit.transport.local import squeezed
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl import NixlTransport


def pulled_box(op: CopyOp, target: torch.Tensor) -> torch.Tensor:
    """The bytes ``op`` placed in ``target``, shaped as its source box ``op.src_box.lengths``
    (undoing the target view and the transpose; a copy where no view can say it)."""
    t = target.view(op.dst_view) if op.dst_view is not None else target
    d = t[op.dst_box.slices()]
    if op.transpose:  # dst = src^T as matrices, 1-dims dropped
        d = squeezed(d, 2).t()
    return d.reshape(op.src_box.lengths)


def _matrix(op: CopyOp, target: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
    """The pulled box as a ``[rows, cols]`` view of ``target`` in source order, or ``None``
    where strides cannot say it without a copy."""
    t = target.view(op.dst_view) if op.dst_view is not None else target
    d = t[op.dst_box.slices()]
    try:
        if op.transpose:
            return squeezed(d, 2).t().view(rows, cols)
        return d.view(rows, cols)
    except RuntimeError:
        return None


def experts_per_rank(m: Manifest) -> int:
    """Routed experts each trainer rank of ``m``'s layout holds (1 for a dense model)."""
    return m.dims.num_experts // m.layout.ep if m.dims.num_experts else 1


_Where = tuple[int, tuple[int, ...], SumFrame]  # (first checksum entry in the rank's block, stored shape, frame)


@dataclass
class _Compiled:
    """One plan's checks against one set of buffers: fused sums, where each slot's published
    value is, and the ops checked the slow way."""

    sums: BoxSums
    want: torch.Tensor  # [slots] int64 index into the published flat buffer
    slots: list[tuple[int, CopyOp, str, int, SumFrame]]  # (first slot, op, kind, first entry, frame)
    slow: list[tuple[CopyOp, int, tuple[int, ...], SumFrame]]  # (op, where its source's sums start, shape, frame)
    checked: int  # bytes
    boxes: int  # ops


class ChecksumVerifier:
    """Pulls the ranks' checksum blocks and checks plans' boxes against them."""

    def __init__(self, transport: NixlTransport, device: torch.device):
        self.transport, self.device = transport, device
        self._flat: torch.Tensor | None = None  # every rank's published sums, back to back
        self._base: dict[RankCoord, int] = {}  # rank -> its block's first entry in the flat buffer
        self._offsets: dict[tuple[str, int], dict[str, _Where]] = {}  # (memory digest, experts) -> name -> where
        self._compiled: dict[tuple, _Compiled] = {}
        self._covered: set[tuple] = set()  # plans (with their manifests) every box of which a sum covers

    def forget(self) -> None:
        """Drop the compiled checks (their views of the receiver's buffers, which are being freed)."""
        self._compiled = {}

    def require(self, plan: Plan, manifests: Mapping[RankCoord, Manifest]) -> None:
        """Check, before anything is pulled, that every box of ``plan`` is covered by a sum its
        trainer rank publishes (cached per plan and manifests).

        Raises:
            MegarefitError: a rank publishes no checksums (names it and the fix).
            UncheckableBoxError: some box is covered by no sum (names the source tensors,
                ranks, boxes, why, and the fix)."""
        _require_checksums(manifests)
        key = (plan.digest, tuple(sorted((r, m.memory_digest) for r, m in manifests.items())))
        if key in self._covered:
            return
        bad = []
        for op in plan.ops:
            _, shape, frame = self._where(manifests[op.src.rank])[op.src.name]
            if box_kind(op, shape, frame) is None:
                bad.append((op, shape, frame))
        if bad:
            raise _uncheckable(bad, len(plan.ops))
        self._covered.add(key)

    def pull(self, manifests: Mapping[RankCoord, Manifest], timeout: float) -> None:
        """READ every rank's checksum block.

        Raises:
            MegarefitError: a rank publishes no checksums (names it and the fix).
            TransferError: as the transport's READs."""
        _require_checksums(manifests)
        sizes = {rank: m.checksums[1] // 8 for rank, m in sorted(manifests.items())}  # type: ignore[index]
        base, at = {}, 0
        for rank, n in sizes.items():
            base[rank] = at
            at += n
        if self._flat is None or base != self._base or self._flat.numel() != at:
            if self._flat is not None:
                self.transport.release([self._flat])
            self._flat, self._base, self._compiled = torch.empty(at, dtype=torch.int64, device=self.device), base, {}
        self.transport.read_blocks([(manifests[r], manifests[r].checksums, self._flat[b:b + sizes[r]])
                                    for r, b in base.items()], timeout=timeout)

    def _where(self, m: Manifest) -> dict[str, _Where]:
        key = (m.memory_digest, experts_per_rank(m))
        if key not in self._offsets:
            at, out = 0, {}
            for t in m.tensors:
                frame = sum_frame(t.shape, t.role, key[1])
                out[t.name] = (at, tuple(t.shape), frame)
                at += frame.numel
            self._offsets[key] = out
        return self._offsets[key]

    def _compile(self, plan: Plan, buffers: Mapping[TensorRef, torch.Tensor],
                 manifests: Mapping[RankCoord, Manifest]) -> _Compiled:
        entries, want, slots, slow, checked, at = [], [], [], [], 0, 0
        for op in plan.ops:
            where, shape, frame = self._where(manifests[op.src.rank])[op.src.name]
            kind = box_kind(op, shape, frame)
            if kind is None:  # require() refused such a plan before the pull
                raise _uncheckable([(op, shape, frame)], len(plan.ops))
            checked += op.nbytes
            what, first, rows, cols = kind
            x = _matrix(op, buffers[op.dst], rows, cols)
            if x is None:
                slow.append((op, self._base[op.src.rank] + where, shape, frame))
                continue
            n = rows if what == "rows" else cols
            entries.append((x, at if what == "rows" else -1, at if what == "cols" else -1, 0))
            start = self._base[op.src.rank] + where + first
            want.append(torch.arange(start, start + n, dtype=torch.int64))
            slots.append((at, op, what, first, frame))
            at += n
        out = torch.zeros(at, dtype=torch.int64, device=self.device)
        index = torch.cat(want).to(self.device) if want else torch.zeros(0, dtype=torch.int64, device=self.device)
        return _Compiled(BoxSums(entries, out), index, slots, slow, checked, len(plan.ops))

    def verify(self, plan: Plan, buffers: Mapping[TensorRef, torch.Tensor], manifests: Mapping[RankCoord, Manifest],
               version: int) -> tuple[int, int]:
        """Check every op of ``plan``, in one fused pass on a GPU (one device sync in all);
        ``(checked bytes, checked boxes)``: every op's.

        Raises:
            ChecksumMismatchError: a box's sums differ from the published ones (names the
                source tensor, rank, row or column, target and version).
            UncheckableBoxError: a box no sum covers (:meth:`require` refuses such a plan first)."""
        assert self._flat is not None
        key = (plan.digest, id(buffers), tuple(sorted((r, m.memory_digest) for r, m in manifests.items())))
        if key not in self._compiled:
            self._compiled[key] = self._compile(plan, buffers, manifests)
        c = self._compiled[key]
        got = c.sums()
        bad = got != self._flat[c.want]
        if c.want.numel() and bool(bad.any()):
            slot = int(bad.nonzero()[0])
            first, op, what, entry, frame = max((s for s in c.slots if s[0] <= slot), key=lambda s: s[0])
            _raise(op, frame, what, entry + slot - first, int(got[slot]), int(self._flat[c.want[slot]]), version)
        for op, where, shape, frame in c.slow:
            what, first, sums = box_sums(op, shape, pulled_box(op, buffers[op.dst]), frame)
            want = self._flat[where + first:where + first + sums.numel()]
            if not torch.equal(sums, want):
                i = int((sums != want).nonzero()[0])
                _raise(op, frame, what, first + i, int(sums[i]), int(want[i]), version)
        return c.checked, c.boxes


def _require_checksums(manifests: Mapping[RankCoord, Manifest]) -> None:
    for rank, m in sorted(manifests.items()):
        if m.checksums is None:
            raise MegarefitError(f"rank {tuple(rank)} publishes no checksums: create its Publisher with "
                                 "checksums=True, or the receiver with verify_checksums=False")


def _uncheckable(bad: list[tuple[CopyOp, tuple[int, ...], SumFrame]], total: int) -> UncheckableBoxError:
    """One error naming every source tensor with a box no published sum covers."""
    names: dict[tuple, list[str]] = {}
    for op, shape, frame in bad:
        where = op.src_box.offsets, op.src_box.lengths
        why = (f"box at {list(where[0])} of lengths {list(where[1])}"
               + (f" of its view {list(op.src_view)}" if op.src_view is not None else "")
               + f" is neither whole rows nor every row of {_matrices(frame)}, as it is summed (stored shape "
               f"{list(shape)})")
        names.setdefault((op.src.name, tuple(op.src.rank)), []).append(why)
    listed = "; ".join(f"{n} of rank {r}: {w[0]}" + (f" (and {len(w) - 1} more box(es))" if len(w) > 1 else "")
                       for (n, r), w in sorted(names.items())[:5])
    more = f"; and {len(names) - 5} more tensor(s)" if len(names) > 5 else ""
    return UncheckableBoxError(
        f"verify_checksums=True cannot check {len(bad)} of the {total} boxes this receiver would pull: {listed}{more}. "
        "Nothing was pulled. Receive with verify_checksums=False, or use a trainer layout (expert_layout, tp, etp) "
        "whose boxes are whole rows or columns of what the trainer sums")


def _matrices(frame: SumFrame) -> str:
    return f"a [{frame.rows}, {frame.cols}] matrix" if frame.batch == 1 else (
        f"{frame.batch} expert matrices [{frame.rows}, {frame.cols}]")


def _raise(op: CopyOp, frame: SumFrame, kind: str, entry: int, got: int, want: int, version: int) -> None:
    b, rows, cols = frame
    index = entry if kind == "rows" else entry - b * rows
    size = rows if kind == "rows" else cols
    where = f"{kind[:-1]} {index % size}" + (f" of expert {index // size}" if b > 1 else "")
    raise ChecksumMismatchError(
        f"checksum mismatch pulling version {version}: {op.src.name} of rank {tuple(op.src.rank)} (summed as "
        f"{_matrices(frame)}), {where}, pulled into {op.dst.name}: sum {got}, published {want}. The bytes "
        "that landed differ from what the trainer rank published for them; the tensors pulled with it were not "
        "handed over")


__all__ = ["ChecksumVerifier", "experts_per_rank", "pulled_box"]
