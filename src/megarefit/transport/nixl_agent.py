"""A NIXL agent (UCX backend) that registers each memory region once and counts its work.

Shared by the receiver's transport (:mod:`~megarefit.transport.nixl`), the trainer's
:class:`~megarefit.online.trainer.publisher.Publisher` and the replicas. ``nixl`` is imported
lazily; install the ``nixl`` extra.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from megarefit.errors import DependencyError, MegarefitError
from megarefit.transport.nics import NicChoice, choose, gpu_address, net_devices


class TransferError(MegarefitError, RuntimeError):
    """A NIXL transfer failed or timed out; names the peer, tensors and byte ranges. ``rank``: the
    trainer rank whose READ failed, where one did (a receiver fails over to another holder)."""

    def __init__(self, message: str, rank: tuple[int, ...] | None = None):
        super().__init__(message)
        self.rank = rank


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MegarefitError("the NIXL transport needs the `nixl` package: pip install 'megarefit[nixl]'") from exc
    return nixl_agent, nixl_agent_config


PROGRESS_DELAY_ENV = "MEGAREFIT_NIXL_PROGRESS_DELAY_US"
"""Microseconds NIXL's progress thread waits between polls (``nixlAgentConfig.pthrDelay``).
The nixl Python API (1.5.1) hard-codes 0: the thread spins a whole core for the agent's life, even
idle. Unset (the default): NIXL's 0. A serving agent (``progress_thread=True``) reads it as it is built.

Raises (when set): :class:`~megarefit.errors.DependencyError` where nixl has no
``nixl.nixlBind.nixlAgentConfig`` to carry it (its internals moved)."""
_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _progress_delay(delay_us: int | None):
    """While a ``nixl_agent`` is built: its config's ``pthrDelay`` set to ``delay_us`` (None: as is)."""
    if not delay_us:
        yield
        return
    import nixl

    bind = getattr(nixl, "nixlBind", None)  # the bindings module nixl_agent builds its config from
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:  # nixl's internals moved: say so rather than spin silently
        from importlib.metadata import version

        raise DependencyError(f"{PROGRESS_DELAY_ENV} is set but nixl {version('nixl')} has no "
                              "nixl.nixlBind.nixlAgentConfig to give the progress-thread delay to; unset it")

    class _Config(base):  # nixl_agent sets pthrDelay = 0 on the config it builds: keep ours
        def __setattr__(self, key, value):
            base.__setattr__(self, key, delay_us if key == "pthrDelay" else value)

    with _CONFIG_LOCK:
        bind.nixlAgentConfig = _Config
        try:
            yield
        finally:
            bind.nixlAgentConfig = base


class NixlAgent:
    """A NIXL agent (UCX backend) with counters for what it registers and prepares.

    ``progress_thread``: NIXL's background progress thread (needed on the serving
    side so peers can connect; it busy-polls a CPU core). A serving agent warns when it
    registers GPU memory of a device that is not the process's current one: measured on two
    H100s (docs/benchmarks.md), a replica serving its arena on ``cuda:1`` from a process
    whose current device was ``cuda:0`` was read through the host at 0.45 GB/s; with that
    device current, 254 GB/s over CUDA IPC. (Creating the agent, registering and exporting
    its metadata under that device, without making it current for the process, did not help.)

    ``device``: the GPU this agent's memory lives on: it reads and serves through the RDMA NIC
    nearest that GPU (``UCX_NET_DEVICES`` while the agent starts; :mod:`~megarefit.transport.nics`,
    ``nic`` says which and why).

    ``counters`` keys: ``registrations`` (register_memory calls), ``registered_bytes``,
    ``remote_agents`` (add_remote_agent calls), ``dlists`` (prepared descriptor
    lists), ``xfers`` (transfer requests created), ``posts`` (transfers posted).
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = True,
                 device: torch.device | None = None):
        nixl_agent, nixl_agent_config = _nixl()
        self.name = name
        address = gpu_address(device) if device is not None and device.type == "cuda" else None
        self.nic: NicChoice | None = None if address is None else choose(address)  # UCX reads it as the agent starts
        delay = int(os.environ.get(PROGRESS_DELAY_ENV) or 0) if progress_thread else 0
        with net_devices(self.nic), _progress_delay(delay):
            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                            backends=list(backends)))
        self.serving = progress_thread  # peers READ what this agent registers
        self.counters: Counter[str] = Counter()
        self._registered: dict[tuple[int, int], Any] = {}
        self._kinds: dict[tuple[int, int], tuple[str, int]] = {}  # region -> NIXL (memory type, device id)
        self._starts: list[tuple[int, int]] = []  # sorted (start, length) of the registrations

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register tensors' memory once (already-registered regions are skipped).

        A view of a larger contiguous tensor (an arena slice, a parameter inside Megatron's
        contiguous parameter buffer) registers that whole tensor once, so runs of
        neighbouring views can travel as one descriptor (:meth:`region`)."""
        roots: dict[tuple[int, int], torch.Tensor] = {}
        for t in tensors:
            if not t.is_contiguous():
                raise MegarefitError(f"cannot register a non-contiguous tensor of shape {tuple(t.shape)}")
            base = t._base if t._base is not None and t._base.is_contiguous() and _inside(t, t._base) else t
            key = (base.data_ptr(), base.numel() * base.element_size())
            if self.region(t.data_ptr(), t.numel() * t.element_size()) is None:
                roots.setdefault(key, base)
        new = [t for key, t in roots.items() if key not in self._registered]
        if not new:
            return
        if self.serving:
            _warn_not_current(self.name, new)
        handle = self.agent.register_memory(list(new))
        for t in new:
            self._registered[(t.data_ptr(), t.numel() * t.element_size())] = handle
            self._kinds[(t.data_ptr(), t.numel() * t.element_size())] = mem_type(t)
        self.counters["registrations"] += 1
        self.counters["registered_bytes"] += sum(t.numel() * t.element_size() for t in new)

    @property
    def regions(self) -> int:
        """Memory regions registered now (one per whole tensor a :meth:`register` call took)."""
        return len(self._registered)

    def registered(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a whole registered tensor, not a view inside one) is registered here."""
        return (tensor.data_ptr(), tensor.numel() * tensor.element_size()) in self._registered

    def deregister(self, tensors: Sequence[torch.Tensor]) -> None:
        """Deregister tensors registered together by one :meth:`register` call (all of that
        call's tensors at once), before their memory is freed.

        Raises:
            MegarefitError: a tensor is not registered, or its call registered others too."""
        keys = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
        handles = {id(self._registered.get(k)): self._registered.get(k) for k in keys}
        together = {k for k, h in self._registered.items() if id(h) in handles}
        if None in handles.values() or together != keys:
            raise MegarefitError("deregister takes exactly the tensors one register call registered")
        for handle in handles.values():
            self.agent.deregister_memory(handle)
        for k in keys:
            del self._registered[k]
            self._kinds.pop(k, None)
        self.counters["deregistrations"] += 1

    def drop(self, starts: Sequence[int]) -> int:
        """Deregister the registered regions that start at ``starts`` (their memory was freed,
        re-allocated or re-mapped: a trainer's declared move), however they were registered; the
        other regions of the same :meth:`register` calls are registered again at once, by address
        (one call per memory type). Returns the bytes dropped.

        Raises:
            MegarefitError: an address in ``starts`` starts no registered region."""
        wanted = set(starts)
        gone = [k for k in self._registered if k[0] in wanted]
        if {k[0] for k in gone} != wanted:
            raise MegarefitError(f"no registered region starts at {sorted(wanted - {k[0] for k in gone})} "
                                 f"(agent {self.name!r})")
        handles = {id(self._registered[k]): self._registered[k] for k in gone}
        kept = [k for k, h in self._registered.items() if id(h) in handles and k[0] not in wanted]
        kinds = {k: self._kinds[k] for k in kept}
        for handle in handles.values():
            self.agent.deregister_memory(handle)
        for k in gone + kept:
            del self._registered[k]
            self._kinds.pop(k, None)
        self.counters["deregistrations"] += len(handles)
        for mem in sorted({m for m, _ in kinds.values()}):  # the survivors, by address
            mine = [k for k in kept if kinds[k][0] == mem]
            handle = self.agent.register_memory([(a, n, kinds[(a, n)][1], "") for a, n in mine], mem)
            for k in mine:
                self._registered[k], self._kinds[k] = handle, kinds[k]
            self.counters["registrations"] += 1
            self.counters["registered_bytes"] += sum(n for _, n in mine)
        return sum(n for _, n in gone)

    def region(self, addr: int, nbytes: int) -> int | None:
        """Start address of the registered region holding bytes ``[addr, addr + nbytes)``
        (an id: equal ids mean one region), or ``None``."""
        if len(self._starts) != len(self._registered):
            self._starts = sorted(self._registered)
        i = bisect.bisect_right(self._starts, (addr, float("inf"))) - 1
        while i >= 0:  # regions do not nest in practice; step back past shorter ones just in case
            start, length = self._starts[i]
            if addr + nbytes <= start + length:
                return start
            i -= 1
            if i >= 0 and self._starts[i][0] + self._starts[i][1] <= addr:
                break
        return None

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()


def _inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie inside ``base``'s (a tensor whose ``.data`` was replaced keeps its old ``_base``)."""
    start = base.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + base.numel() * base.element_size()


def _warn_not_current(name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Warn when GPU memory this agent serves is not on the process's current device."""
    devices = {t.device for t in tensors if t.is_cuda}
    other = sorted(str(d) for d in devices if d.index != torch.cuda.current_device())
    if other:
        warnings.warn(f"NIXL agent {name!r} serves GPU memory on {', '.join(other)} while the process's current "
                      f"device is cuda:{torch.cuda.current_device()}: UCX then serves it to peers through the host "
                      "(0.45 GB/s instead of ~250 GB/s over CUDA IPC, measured on two H100s). Call "
                      "torch.cuda.set_device(<that device>) before creating the publisher or replica receiver.",
                      stacklevel=3)


def mem_type(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's bytes: ``("VRAM", cuda index)`` or ``("DRAM", 0)``."""
    if t.is_cuda:
        return "VRAM", t.device.index or 0
    return "DRAM", 0


__all__ = ["NixlAgent", "TransferError", "mem_type"]
