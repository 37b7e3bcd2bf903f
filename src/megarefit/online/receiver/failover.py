"""Failover: a trainer rank whose READ failed mid-cycle is read from no more, its share from
other holders of the same version (every data-parallel copy serves: planner/holders.py).

A staged cycle whose READ from rank R fails (the process died, its link went down, or the READ
timed out) is pulled again, the same fence and version rules, from a plan that excludes R: every
tensor R served goes to another of its holders, the rest stay where they were. ``stats.failovers``
names R and the ranks that took its share. With no other holder of some tensor the cycle fails
naming R; nothing of that cycle was handed over. R is read again once it re-registers (its
generation key changes: a restarted trainer publishes a new manifest).

A streamed cycle fails over mid-stream (:mod:`~megarefit.online.receiver.streamed`): the groups
handed over stay, the group in flight and the rest are re-planned onto the other holders, in the
same ring, the fence extended to them; with no other holder it fails naming R, the groups handed
over before it being of the fenced version but the install incomplete.
"""

from __future__ import annotations

from typing import Any

from megarefit.errors import NoHolderError
from megarefit.layout import RankCoord
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.transport.nixl_agent import TransferError


class Failover:
    """The ranks a receiver excluded, and when to read them again (see the module docstring).
    ``plans``: the receiver's :class:`~megarefit.online.receiver.plan_cache.PlanCache`."""

    def __init__(self, rendezvous: Rendezvous, plans: Any):
        self.rendezvous = rendezvous
        self.plans = plans
        self._gone: dict[RankCoord, bytes | None] = {}  # excluded rank -> its generation when it failed

    def readmit(self) -> list[RankCoord]:
        """Read again the excluded ranks that re-registered since they failed; returns them."""
        if not self._gone:
            return []
        now = self.rendezvous.generations(list(self._gone))
        back = [r for r, gen in self._gone.items() if now[r] is not None and now[r] != gen]
        for r in back:
            del self._gone[r]
            self.plans.readmit(r)
        return back

    def fail(self, exc: TransferError) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Exclude the rank ``exc`` names; returns ``(rank, the ranks that serve its share)``.

        Raises:
            TransferError: ``exc`` itself where it names no rank or that rank was excluded already
                (then the pull failed elsewhere), or naming the rank where some tensor it served
                has no other holder."""
        if exc.rank is None or RankCoord(*exc.rank) in self._gone:
            raise exc
        rank = RankCoord(*exc.rank)
        try:
            replaced = self.plans.fail_over(rank)
        except NoHolderError as why:
            raise TransferError(f"{exc}; and no other trainer rank serves its share: {why}", rank=exc.rank) from exc
        self._gone[rank] = self.rendezvous.generations([rank])[rank]
        return tuple(rank), tuple(tuple(r) for r in replaced)


__all__ = ["Failover"]
