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

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.checksum import ChecksumMismatchError, box_sums, checksum_numel, matrix_shape
from megarefit.transport.manifest import Manifest
from megarefit.transport.nixl import NixlTransport


def pulled_box(op: CopyOp, target: torch.Tensor) -> torch.Tensor:
    """The bytes ``op`` placed in ``target``, shaped as its source box ``op.src_box.lengths``
    (undoing the target view and the transpose)."""
    t = target.view(op.dst_view) if op.dst_view is not None else target
    d = t[op.dst_box.slices()]
    if op.transpose:  # dst = src^T over the last two dims, leading 1-dims dropped
        d = d.reshape(d.shape[-2:]).t()
    return d.reshape(op.src_box.lengths)


class ChecksumVerifier:
    """Pulls the ranks' checksum blocks and checks plans' boxes against them."""

    def __init__(self, transport: NixlTransport, device: torch.device):
        self.transport, self.device = transport, device
        self._local: dict[RankCoord, torch.Tensor] = {}
        self._offsets: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {}  # memory digest -> name -> (at, shape)

    def pull(self, manifests: Mapping[RankCoord, Manifest], timeout: float) -> None:
        """READ every rank's checksum block.

        Raises:
            MegarefitError: a rank publishes no checksums (names it and the fix).
            TransferError: as the transport's READs."""
        reads = []
        for rank, m in sorted(manifests.items()):
            if m.checksums is None:
                raise MegarefitError(f"rank {tuple(rank)} publishes no checksums: create its Publisher with "
                                     "checksums=True, or the receiver with verify_checksums=False")
            n = m.checksums[1] // 8
            if rank not in self._local or self._local[rank].numel() != n:
                self._local[rank] = torch.empty(n, dtype=torch.int64, device=self.device)
            reads.append((m, m.checksums, self._local[rank]))
        self.transport.read_blocks(reads, timeout=timeout)

    def _where(self, m: Manifest) -> dict[str, tuple[int, tuple[int, ...]]]:
        key = m.memory_digest
        if key not in self._offsets:
            at, out = 0, {}
            for t in m.tensors:
                out[t.name] = (at, tuple(t.shape))
                at += checksum_numel(t.shape)
            self._offsets[key] = out
        return self._offsets[key]

    def verify(self, plan: Plan, buffers: Mapping[TensorRef, torch.Tensor], manifests: Mapping[RankCoord, Manifest],
               version: int) -> tuple[int, int]:
        """Check every op of ``plan`` whose box allows it (one device sync in all);
        ``(checked, unchecked)`` bytes.

        Raises:
            ChecksumMismatchError: a box's sums differ from the published ones (names the
                source tensor, rank, row or column, target and version)."""
        checks, checked, unchecked = [], 0, 0
        for op in plan.ops:
            at, shape = self._where(manifests[op.src.rank])[op.src.name]
            got = box_sums(op, shape, pulled_box(op, buffers[op.dst]))
            if got is None:
                unchecked += op.nbytes
                continue
            kind, first, sums = got
            checks.append((op, shape, kind, first, sums, self._local[op.src.rank][at + first:at + first + sums.numel()]))
            checked += op.nbytes
        if checks:
            ok = torch.stack([(c[4] == c[5]).all() for c in checks])
            if not bool(ok.all()):
                _raise(checks[int((~ok).nonzero()[0])], version)
        return checked, unchecked


def _raise(check: tuple, version: int) -> None:
    op, shape, kind, first, sums, want = check
    bad = int((sums != want).nonzero()[0])
    index = first + bad if kind == "rows" else first + bad - matrix_shape(shape)[0]
    raise ChecksumMismatchError(
        f"checksum mismatch pulling version {version}: {op.src.name} of rank {tuple(op.src.rank)} (stored shape "
        f"{list(shape)}), {kind[:-1]} {index}, pulled into {op.dst.name}: sum {int(sums[bad])}, published "
        f"{int(want[bad])}. The bytes that landed differ from what the trainer rank published for them; the "
        "tensors pulled with it were not handed over")


__all__ = ["ChecksumVerifier", "pulled_box"]
