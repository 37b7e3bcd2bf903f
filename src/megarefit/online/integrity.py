"""A receiver's checksum checks: every pulled box against what its trainer rank published.

``RefitReceiver(verify_checksums=True)`` with ``Publisher(checksums=True)`` trainers: each
cycle READs every rank's checksum block (:mod:`megarefit.transport.checksum`: row and column
sums of each served tensor, rewritten inside the rank's seqlock by every publish; about
``8 * (R + C)`` bytes per ``[R, C]`` tensor) and, on the receiver's device, recomputes the
sums of each op's box from the bytes that landed in the arena or ring, before any of them is
handed over. A box that is neither whole rows nor whole columns of its source is counted as
unchecked (``CycleStats.unchecked_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.checksum import ChecksumMismatchError, box_kind, box_sums, checksum_numel, matrix_shape
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


@dataclass
class _Compiled:
    """One plan's checks against one set of buffers: fused sums, where each slot's published
    value is, and the ops checked the slow way."""

    sums: BoxSums
    want: torch.Tensor  # [slots] int64 index into the published flat buffer
    slots: list[tuple[int, CopyOp, str, int, tuple[int, ...]]]  # (first slot, op, kind, first entry, shape)
    slow: list[tuple[CopyOp, int, tuple[int, ...]]]  # (op, where its source's sums start, shape)
    checked: int
    unchecked: int


class ChecksumVerifier:
    """Pulls the ranks' checksum blocks and checks plans' boxes against them."""

    def __init__(self, transport: NixlTransport, device: torch.device):
        self.transport, self.device = transport, device
        self._flat: torch.Tensor | None = None  # every rank's published sums, back to back
        self._base: dict[RankCoord, int] = {}  # rank -> its block's first entry in the flat buffer
        self._offsets: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {}  # memory digest -> name -> (at, shape)
        self._compiled: dict[tuple, _Compiled] = {}

    def forget(self) -> None:
        """Drop the compiled checks (their views of the receiver's buffers, which are being freed)."""
        self._compiled = {}

    def pull(self, manifests: Mapping[RankCoord, Manifest], timeout: float) -> None:
        """READ every rank's checksum block.

        Raises:
            MegarefitError: a rank publishes no checksums (names it and the fix).
            TransferError: as the transport's READs."""
        sizes = {}
        for rank, m in sorted(manifests.items()):
            if m.checksums is None:
                raise MegarefitError(f"rank {tuple(rank)} publishes no checksums: create its Publisher with "
                                     "checksums=True, or the receiver with verify_checksums=False")
            sizes[rank] = m.checksums[1] // 8
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

    def _where(self, m: Manifest) -> dict[str, tuple[int, tuple[int, ...]]]:
        key = m.memory_digest
        if key not in self._offsets:
            at, out = 0, {}
            for t in m.tensors:
                out[t.name] = (at, tuple(t.shape))
                at += checksum_numel(t.shape)
            self._offsets[key] = out
        return self._offsets[key]

    def _compile(self, plan: Plan, buffers: Mapping[TensorRef, torch.Tensor],
                 manifests: Mapping[RankCoord, Manifest]) -> _Compiled:
        entries, want, slots, slow, checked, unchecked, at = [], [], [], [], 0, 0, 0
        for op in plan.ops:
            where, shape = self._where(manifests[op.src.rank])[op.src.name]
            kind = box_kind(op, shape)
            if kind is None:
                unchecked += op.nbytes
                continue
            checked += op.nbytes
            what, first, rows, cols = kind
            x = _matrix(op, buffers[op.dst], rows, cols)
            if x is None:
                slow.append((op, self._base[op.src.rank] + where, shape))
                continue
            n = rows if what == "rows" else cols
            entries.append((x, at if what == "rows" else -1, at if what == "cols" else -1, 0))
            start = self._base[op.src.rank] + where + first
            want.append(torch.arange(start, start + n, dtype=torch.int64))
            slots.append((at, op, what, first, shape))
            at += n
        out = torch.zeros(at, dtype=torch.int64, device=self.device)
        index = torch.cat(want).to(self.device) if want else torch.zeros(0, dtype=torch.int64, device=self.device)
        return _Compiled(BoxSums(entries, out), index, slots, slow, checked, unchecked)

    def verify(self, plan: Plan, buffers: Mapping[TensorRef, torch.Tensor], manifests: Mapping[RankCoord, Manifest],
               version: int) -> tuple[int, int]:
        """Check every op of ``plan`` whose box allows it, in one fused pass on a GPU (one
        device sync in all); ``(checked, unchecked)`` bytes.

        Raises:
            ChecksumMismatchError: a box's sums differ from the published ones (names the
                source tensor, rank, row or column, target and version)."""
        assert self._flat is not None
        key = (plan.digest, id(buffers), tuple(sorted((r, m.memory_digest) for r, m in manifests.items())))
        if key not in self._compiled:
            self._compiled[key] = self._compile(plan, buffers, manifests)
        c = self._compiled[key]
        got = c.sums()
        bad = got != self._flat[c.want]
        if c.want.numel() and bool(bad.any()):
            slot = int(bad.nonzero()[0])
            first, op, what, entry, shape = max((s for s in c.slots if s[0] <= slot), key=lambda s: s[0])
            _raise(op, shape, what, entry + slot - first, int(got[slot]), int(self._flat[c.want[slot]]), version)
        for op, where, shape in c.slow:
            what, first, sums = box_sums(op, shape, pulled_box(op, buffers[op.dst]))
            want = self._flat[where + first:where + first + sums.numel()]
            if not torch.equal(sums, want):
                i = int((sums != want).nonzero()[0])
                _raise(op, shape, what, first + i, int(sums[i]), int(want[i]), version)
        return c.checked, c.unchecked


def _raise(op: CopyOp, shape: tuple[int, ...], kind: str, entry: int, got: int, want: int, version: int) -> None:
    index = entry if kind == "rows" else entry - matrix_shape(shape)[0]
    raise ChecksumMismatchError(
        f"checksum mismatch pulling version {version}: {op.src.name} of rank {tuple(op.src.rank)} (stored shape "
        f"{list(shape)}), {kind[:-1]} {index}, pulled into {op.dst.name}: sum {got}, published {want}. The bytes "
        "that landed differ from what the trainer rank published for them; the tensors pulled with it were not "
        "handed over")


__all__ = ["ChecksumVerifier", "pulled_box"]
