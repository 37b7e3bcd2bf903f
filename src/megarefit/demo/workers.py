"""Worker processes for real Megatron-Core on CPU: one process per rank over gloo.

:func:`run_workers` starts ``world_size`` processes (torch.multiprocessing), each calling
``fn(rank, world_size, master_port, *args)`` and sending back its result (pickled) or its
traceback; :func:`start_workers` does the same without waiting (:class:`WorkerGroup`). The
master port is picked by the OS unless given.

Workers are ``spawn``ed (each imports torch, megatron.core and transformers afresh: seconds of CPU
per rank) or, with ``start_method="forkserver"`` (or ``MEGAREFIT_WORKER_START=forkserver``), forked
from a server process that imported them once. Forkserver workers end with ``os._exit``: no
interpreter shutdown, so nothing registered to run at exit does. vLLM's CPU shared-memory groups
seem to unlink their segments only then (vLLM jobs in forkserver workers met ``EEXIST`` creating
them), so a job that starts vLLM's distributed state must be spawned; a forkserver worker that
finds one refuses (:data:`SPAWN_ONLY`).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Collection
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now (for a gloo master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHODS = ("spawn", "forkserver")
PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers")  # what the forkserver imports once
# modules whose state needs the interpreter's shutdown (vLLM's CPU shared-memory group unlinks its segments)
SPAWN_ONLY = ("vllm.distributed",)


def _worker(rank: int, world_size: int, master_port: int, job: bytes, q: Any, env: dict[str, str] | None) -> None:
    if env is not None:  # a forkserver worker: the starting process's environment, as a spawned one has it
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn, args = torch.load(io.BytesIO(job), weights_only=False)  # our own parent's bytes, over a pipe
        result = fn(rank, world_size, master_port, *args)
        if env is not None and any(m in sys.modules for m in SPAWN_ONLY):
            raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} started vLLM's distributed state in a forkserver "
                               "worker, which exits without vLLM's shared-memory cleanup: run it with "
                               "start_method='spawn'")
        payload = ("ok", pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        payload = ("err", traceback.format_exc())
    q.put((rank, *payload))
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(start_method: str | None) -> Any:
    """The multiprocessing context of ``start_method`` (default: ``MEGAREFIT_WORKER_START`` or
    ``spawn``). The forkserver is started by the first group that asks for it and lives as long as
    this process; it runs no torch op (no thread pool to inherit).

    Raises:
        ValueError: an unknown start method."""
    method = start_method or os.environ.get("MEGAREFIT_WORKER_START") or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"worker start method {method!r}: expected one of {START_METHODS}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class WorkerGroup:
    """Worker processes started by :func:`start_workers`; :meth:`join` collects their results."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple, master_port: int | None,
                 start_method: str | None = None):
        self.world_size = world_size
        self.port = master_port if master_port is not None else free_port()
        ctx = _context(start_method)
        self._q = ctx.Queue()
        self._early: dict[int, bytes] = {}  # results :meth:`check` took off the queue
        env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
        # torch.save: tensors travel by value, float8 included (multiprocessing's pickler would pass each
        # through a file descriptor, and a forkserver takes fewer than 256 per process)
        buf = io.BytesIO()
        torch.save((fn, args), buf)
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, self.port, buf.getvalue(), self._q, env),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def kill(self, rank: int) -> None:
        """Kill one worker (fault-injection in tests) and wait until it is gone (its memory
        unmapped), so that what happens next really meets a dead peer."""
        self._procs[rank].kill()
        self._procs[rank].join(timeout=30)

    def check(self) -> None:
        """Raise now if a worker failed or died (what :meth:`join` would raise), without waiting:
        for a caller that waits on the workers some other way (a receiver pulling from them)."""
        while True:
            try:
                rank, status, payload = self._q.get_nowait()
            except queue.Empty:
                break
            if status == "err":
                raise RuntimeError(f"worker {rank} failed:\n{payload}")
            self._early[rank] = payload
        dead = [f"worker {r} died with exit code {p.exitcode}" for r, p in enumerate(self._procs)
                if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError("; ".join(dead))

    def join(self, timeout: float = 600.0, killed: Collection[int] = ()) -> list:
        """Wait for every worker's result, ordered by rank (``None`` for the ranks in ``killed``:
        the caller killed them, :meth:`kill`; their death is not an error).

        Raises ``RuntimeError`` carrying the worker's traceback if any worker fails
        or dies, and ``TimeoutError`` after ``timeout`` seconds; remaining workers
        are killed.
        """
        procs, q, world_size = self._procs, self._q, self.world_size
        results: dict[int, Any] = {r: pickle.loads(payload) for r, payload in self._early.items()}
        deadline = time.monotonic() + timeout
        dead_since: dict[int, float] = {}
        want = world_size - len(set(killed))
        try:
            while len(results.keys() - set(killed)) < want:
                try:
                    rank, status, payload = q.get(timeout=0.2)
                except queue.Empty:
                    now = time.monotonic()
                    if now > deadline:
                        raise TimeoutError(f"workers did not finish within {timeout}s") from None
                    for r, p in enumerate(procs):
                        # a dead worker may still have its result in the pipe: short grace period
                        if r not in results and r not in killed and p.exitcode is not None:
                            if now - dead_since.setdefault(r, now) > 5.0:
                                raise RuntimeError(f"worker {r} died with exit code {p.exitcode} without a result")
                    continue
                if status == "err":
                    dead = [f"worker {r} exited with code {p.exitcode}"
                            for r, p in enumerate(procs) if r != rank and r not in killed and p.exitcode not in (None, 0)]
                    note = f" ({'; '.join(dead)})" if dead else ""
                    raise RuntimeError(f"worker {rank} failed{note}:\n{payload}")
                results[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive() and len(results.keys() - set(killed)) < want:
                    p.kill()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
            q.close()
        return [results.get(r) if r in killed else results[r] for r in range(world_size)]


def start_workers(fn: Callable[..., Any], *, world_size: int, args: tuple = (),
                  master_port: int | None = None, start_method: str | None = None) -> WorkerGroup:
    """Start ``fn(rank, world_size, master_port, *args)`` in ``world_size`` processes, started by
    ``start_method`` (``"spawn"`` or ``"forkserver"``; default ``MEGAREFIT_WORKER_START`` or spawn).

    ``fn`` must be picklable (module level) and return a picklable result
    (tensors are sent by value). Returns at once; call ``.join()`` for results.
    """
    return WorkerGroup(fn, world_size, args, master_port, start_method)


PORT_TRIES = 3  # starts of run_workers whose gloo master port was taken before rank 0 bound it


def run_workers(fn: Callable[..., Any], *, world_size: int, args: tuple = (), master_port: int | None = None,
                timeout: float = 600.0, start_method: str | None = None) -> list:
    """:func:`start_workers` then ``join(timeout)``: results ordered by rank.

    Without ``master_port`` the port is one :func:`free_port` found free; another process on the
    host may take it before rank 0 binds it. Such a start (a worker failing with ``EADDRINUSE``)
    runs again on a new port, up to :data:`PORT_TRIES` times in all; ``fn`` must then be safe to
    run again (every job here sets up its process group first).

    Raises:
        RuntimeError / TimeoutError: as :meth:`WorkerGroup.join`."""
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return start_workers(fn, world_size=world_size, args=args, master_port=master_port,
                                 start_method=start_method).join(timeout)
        except RuntimeError as exc:
            if master_port is not None or "EADDRINUSE" not in str(exc) or attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- HF configs and jobs


__all__ = ["PRELOAD", "SPAWN_ONLY", "START_METHODS", "WorkerGroup", "free_port", "run_workers", "start_workers"]
