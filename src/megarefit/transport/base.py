"""The transport protocol: execute plan ops into a destination tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from megarefit.plan import CopyOp


@runtime_checkable
class Transport(Protocol):
    """Moves the bytes of :class:`~megarefit.plan.CopyOp` s.

    ``pull`` executes ops that all target ``out`` (the whole target tensor,
    shape ``plan.targets[op.dst].shape``): a ``"contiguous"`` op is one run on
    both sides; a ``"scratch"`` op's source is one run and its target box is
    strided. Implementations raise with the peer, tensor and byte range on failure.

    ``view`` returns a zero-copy tensor of an op's source box when the source
    lives in this process's memory, else ``None``.
    """

    def pull(self, ops: Sequence[CopyOp], out: torch.Tensor) -> None: ...

    def view(self, op: CopyOp) -> torch.Tensor | None: ...
