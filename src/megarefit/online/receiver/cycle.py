"""What a refit cycle reports: its errors, its :class:`CycleStats`, and the timing of its stages.

The lowest of the receiver's modules (:mod:`~megarefit.online.receiver.receiver` re-exports every
name here)::

    receiver (RefitReceiver, the facade)
      -> pipeline (staged / streamed cycles)
        -> fence (versions, seqlock) | plan_cache (plans per placement) | receiver_memory (arena, ring)
          -> cycle (errors, stats, laps)
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from megarefit.errors import MegarefitError


class VersionMismatchError(MegarefitError):
    """Trainer ranks do not (all) publish the requested weight version."""


class StaleVersionError(VersionMismatchError):
    """A trainer rank wrote its weights (published a new version, or was inside
    ``Publisher.updating``) while its bytes were being read; ``retryable``: a new pull can
    succeed (no specific version was asked for, or the asked version is still served)."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class TornUpdateError(StaleVersionError):
    """A streamed cycle handed tensors over, then saw a trainer rank move past the version or
    write during the pull: the consumer holds a mix of versions and must not serve it until a
    refit cycle completes."""


@dataclass
class CycleStats:
    """One refit cycle: seconds per stage, bytes moved, and whether it was cold."""

    version: int
    cold: bool
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0  # bytes the plan places (its targets' bytes); a delta cycle: the bytes it read
    model_bytes: int = 0
    wire_bytes: int = 0  # bytes the READs move (>= bytes_moved: gathered runs include the gaps between pieces)
    counters: dict[str, int] = field(default_factory=dict)
    arena_bytes: int = 0  # receiver memory holding the targets (bytes)
    scratch_bytes: int = 0  # receiver scratch for gathered pulls (bytes; bounded by ``scratch_budget``, reused)
    descriptors: int = 0  # NIXL READ descriptors per cycle (direct pulls + gathered runs)
    retries: int = 0  # pulls rejected because a rank wrote during them (seqlock), then pulled again
    install: str = "staged"  # "staged": the whole share in an arena; "streamed": groups through a ring
    peak_extra_bytes: int = 0  # receiver memory held at once for the pull: arena or ring, plus scratch (bytes)
    groups: int = 1  # groups handed over one after the other (streamed)
    checked_bytes: int = 0  # verify_checksums: bytes whose boxes were checked against the trainers' checksums
    unchecked_bytes: int = 0  # always 0: verify_checksums refuses a plan with a box no published sum covers
    checked_boxes: int = 0  # verify_checksums: boxes (plan ops) checked, every one the cycle pulled
    direct_bytes: int = 0  # streamed with ``direct``: bytes READ straight into the consumer's tensors
    ipc_bytes: int = 0  # bytes copied from trainer ranks on this GPU through CUDA IPC (part of ``wire_bytes``)
    ipc_ranks: int = 0  # trainer ranks read through CUDA IPC
    refit: str = "full"  # "full", or "delta": only the elements changed since ``delta_base`` were read
    delta_base: int | None = None  # a delta cycle: the version the arena held before it
    delta_reason: str = ""  # a full staged cycle: why it was not a delta (e.g. "first cycle", a version not kept)
    delta_tensors: int = 0  # a delta cycle: source tensors patched with their changed elements
    full_tensors: int = 0  # a delta cycle: source tensors read whole (cheaper than their delta)
    changed_elements: int = 0  # a delta cycle: changed elements read (summed over the versions caught up)
    prefetched: bool = False  # pulled and fenced ahead on a background thread (RefitReceiver.prefetch)
    prefetch_wait_s: float = 0.0  # prefetched: seconds the handover waited for the pull still running
    nic_bytes: dict[str, int] = field(default_factory=dict)  # bytes each RDMA port of the node moved during the pull
    # trainer ranks whose READs failed this cycle, each with the ranks that served its share instead
    # (staged: the cycle was pulled again from them; streamed: the groups not yet handed over; the same
    # version: planner/holders.py)
    failovers: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...] = ()
    # memory (bytes) held at the cycle's end for READs that timed out and are still in flight: an
    # arena and scratch they may still write, never read again, freed once they end (transport/quarantine.py)
    quarantined_bytes: int = 0
    # a node group (RefitReceiver(node=n)): bytes copied from node-mates' arenas over the same-host path
    # (not in ``wire_bytes``, which counts what this receiver READ from the trainers), and the mates whose
    # share it pulled itself this cycle, each with why (online/receiver/node_share.py)
    node_bytes: int = 0
    node_fallbacks: tuple[tuple[str, str], ...] = ()


class Laps:
    """Seconds per stage of a cycle: ``lap(stage)`` records the time since the previous lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._t
        self._t = now

    def restart(self) -> None:
        """Start the next stage now (time in between is not counted)."""
        self._t = time.perf_counter()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for the block (restored after): a cold cycle allocates enough
    objects to trigger full collections of a heap that torch made large (a cold-cycle profile
    on an H200 host showed 77 ms inside a trivial generator: a collection's signature)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["CycleStats", "Laps", "StaleVersionError", "TornUpdateError", "VersionMismatchError", "gc_paused"]
