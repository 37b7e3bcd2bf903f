"""Memory that READs which timed out may still write: held, never reused, until they end.

A NIXL READ released after its timeout still lands over UCX TCP once the peer progresses
(tests/test_cluster.py::test_a_read_released_after_its_timeout_still_lands_once_the_worker_progresses).
:meth:`~megarefit.transport.nixl.NixlTransport.wait` first waits up to its ``grace`` for the READs in
flight to end. Where some are still in flight after it (a link left down: UCX keeps them posted),
nothing may be pulled into the memory they write. A receiver that fails over hands that memory
(its arena, the transport's scratch) and every request prepared on it to a :class:`Quarantine`,
which keeps it allocated and registered, and the requests unreleased, until every one of those
READs has ended (done or failed); the receiver pulls into fresh memory meanwhile::

    arena A  <-- late READ from rank R (may land any time)      held, never read again
    arena B  <-- the failover's READs from R's other holders    fresh: what the cycle hands over

:meth:`Quarantine.sweep` (at the start of every staged cycle) frees what the ended READs held.
The cost is a second arena while the late READs run; ``counters["quarantined_bytes"]`` and
:attr:`Quarantine.nbytes` say how much.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.transport.nixl_agent import NixlAgent
from megarefit.transport.nixl_requests import PreparedPlan, release_requests


@dataclass
class Held:
    """One quarantine: the READs still in flight, the memory and requests they may use."""

    pending: list[Any]  # NIXL request handles not ended when quarantined
    memory: list[list[torch.Tensor]]  # each group registered by one register call
    prepared: list[PreparedPlan]  # requests prepared on that memory (some of them in flight)
    blocks: list[tuple[Any, ...]]  # block-read requests, likewise
    nbytes: int
    why: str
    keep: list[torch.Tensor]  # memory held alive but not deregistered here (registered with other memory, or not)


def _running(agent: Any, handles: Iterable[Any]) -> list[Any]:
    """The handles whose transfer is still in flight (one check each; a failed check: ended)."""
    still = []
    for handle in handles:
        try:
            state = agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 -- failed: nothing more lands from it
            continue
        if state not in ("DONE", "ERR"):
            still.append(handle)
    return still


class Quarantine:
    """What READs that timed out may still write, per late pull (see the module docstring)."""

    def __init__(self, nixl: NixlAgent):
        self.nixl = nixl
        self.held: list[Held] = []

    @property
    def nbytes(self) -> int:
        """Bytes of memory held now."""
        return sum(h.nbytes for h in self.held)

    def hold(self, pending: Sequence[Any], memory: Sequence[Sequence[torch.Tensor]],
             prepared: Sequence[PreparedPlan], blocks: Sequence[tuple[Any, ...]], why: str,
             keep: Sequence[torch.Tensor] = ()) -> int:
        """Hold ``memory`` (groups of tensors, each registered by one register call) and ``keep``
        (held alive only) and the requests until the ``pending`` request handles end; returns the
        bytes held."""
        groups = [list(g) for g in memory if g]
        nbytes = sum(t.numel() * t.element_size() for t in [*(t for g in groups for t in g), *keep])
        self.held.append(Held(list(pending), groups, list(prepared), list(blocks), nbytes, why, list(keep)))
        return nbytes

    def sweep(self) -> int:
        """Free what every quarantine whose READs all ended holds: requests released, memory
        deregistered and dropped; returns the bytes freed."""
        freed, kept = 0, []
        for held in self.held:
            held.pending = _running(self.nixl.agent, held.pending)
            if held.pending:
                kept.append(held)
                continue
            release_requests(held.prepared, held.blocks)
            for group in held.memory:  # ended: a failed deregistration only leaves a registration behind
                with contextlib.suppress(Exception):
                    self.nixl.deregister(group)
            freed += held.nbytes
        self.held = kept
        return freed
