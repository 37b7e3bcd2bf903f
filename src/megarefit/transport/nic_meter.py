"""Bytes per RDMA port around a refit cycle, and the warnings they support.

Per-port bytes come from the port counters (``counters/port_xmit_data`` / ``port_rcv_data``,
in 4-byte words per the InfiniBand spec). The counters are the node's, so one process reads
every GPU's traffic and the node's other traffic (training collectives, storage) too. Two
checks read them (:meth:`NicMeter.stop`):

* **funnel** (:func:`funnelled`): a NIC whose GPUs pulled bytes during the cycle, that carried
  less than half of them, while the node's other ports carried at least the rest. That is
  openucx/ucx#11680's failure (UCX putting several GPUs on one NIC), seen from the GPU whose
  NIC was passed over. A NIC whose GPUs pulled nothing is idle and fine; bytes that crossed no
  NIC at all (trainer ranks on the same node, over NVLink) are not a funnel either;
* **balance** (:func:`unbalanced`): among the GPUs' NICs that moved bytes, the busiest carried
  more than 1.5x their mean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from megarefit.transport.nic_sysfs import SYSFS, RdmaPort, gpus, rdma_ports, read_text
from megarefit.transport.nics import assign

FUNNEL_SHARE = 0.5
"""A NIC carrying less than this share of the bytes its GPUs pulled is passed over."""


def port_bytes(ports: Sequence[RdmaPort], root: str = SYSFS) -> dict[str, tuple[int, int]]:
    """``{mlx5_0:1: (bytes sent, bytes received)}`` from each port's counters (``port_xmit_data``
    and ``port_rcv_data`` count 4-byte words); a port without counters is left out."""
    out = {}
    for p in ports:
        base = os.path.join(root, "class", "infiniband", p.device, "ports", str(p.port), "counters")
        xmit = read_text(os.path.join(base, "port_xmit_data"))
        rcv = read_text(os.path.join(base, "port_rcv_data"))
        if xmit.isdigit() and rcv.isdigit():
            out[p.ucx_name] = (4 * int(xmit), 4 * int(rcv))
    return out


def traffic(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Bytes each port moved (sent + received) between two :func:`port_bytes` readings."""
    return {k: (after[k][0] - before[k][0]) + (after[k][1] - before[k][1]) for k in after if k in before}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def funnelled(moved: Mapping[str, int], served: Mapping[str, Sequence[str]], pulled: Mapping[str, int]) -> str | None:
    """A warning naming each NIC passed over (module docstring), its GPUs and the bytes, and
    the ports that carried the traffic; else ``None``.

    ``moved``: bytes per port (:func:`traffic`); ``served``: ``{port: GPU addresses it was
    given}``; ``pulled``: ``{GPU address: bytes it pulled over NIXL meanwhile}`` (the GPUs this
    process knows of; others count as pulling nothing)."""
    short: dict[str, str] = {}
    for port, gpu_list in sorted(served.items()):
        pulling = [g for g in gpu_list if pulled.get(g, 0) > 0]
        want, got = sum(pulled[g] for g in pulling), moved.get(port, 0)
        elsewhere = sum(v for k, v in moved.items() if k != port)
        if want > 0 and got < FUNNEL_SHARE * want and elsewhere >= want - got:
            who = f"GPU {pulling[0]}" if len(pulling) == 1 else \
                "GPUs " + ", ".join(f"{g} ({_gb(pulled[g])})" for g in pulling)
            short[port] = f"{port} carried {_gb(got)} while its {who} pulled {_gb(want)}"
    if not short:
        return None
    busy = sorted((k for k, v in moved.items() if v > 0 and k not in short), key=lambda k: (-moved[k], k))
    return (f"NIC funnel: {'; '.join(short.values())}; the bytes went through "
            f"{', '.join(f'{k} ({_gb(moved[k])})' for k in busy)} "
            "(is UCX_NET_DEVICES set for each agent? openucx/ucx#11680)")


def unbalanced(moved: Mapping[str, int], expected: Sequence[str], threshold: float = 1.5) -> str | None:
    """A warning when the ports in ``expected`` carried unevenly: the busiest over the mean by
    more than ``threshold``, or a port idle while others moved bytes; else ``None``."""
    loads = {k: moved.get(k, 0) for k in expected}
    total = sum(loads.values())
    if len(loads) < 2 or total == 0:
        return None
    mean = total / len(loads)
    busiest = max(loads, key=lambda k: loads[k])
    idle = sorted(k for k, v in loads.items() if v == 0)
    if loads[busiest] <= threshold * mean and not idle:
        return None
    return (f"NIC traffic unbalanced: {busiest} moved {_gb(loads[busiest])}, {loads[busiest] / mean:.2f}x "
            f"the mean of {len(loads)} NICs" + (f"; idle: {', '.join(idle)}" if idle else "")
            + " (is UCX_NET_DEVICES set per process? openucx/ucx#11680)")


class NicMeter:
    """The node's RDMA port counters read around a cycle: ``start()``, then ``stop(pulled)``
    gives the bytes each port moved meanwhile and a warning (module docstring) or ``None``.
    ``served``: ``{port: GPU addresses}`` of the node's pairing (:func:`~megarefit.transport.nics.assign`,
    the same in every process). Empty (and free) on a host without RDMA ports."""

    def __init__(self, root: str = SYSFS, dev: str = "/dev"):
        self.root = root
        every = rdma_ports(root, active_only=False, dev=dev)
        self.ports = [p for p in every if p.healthy]
        served: dict[str, list[str]] = {}
        for gpu, choice in assign(gpus(root), every).items():
            if choice.value:
                served.setdefault(choice.value, []).append(gpu)
        self.served = {k: tuple(v) for k, v in sorted(served.items())}
        self.expected = sorted(self.served)
        self._before: dict[str, tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.ports)

    def start(self) -> None:
        self._before = port_bytes(self.ports, self.root) if self.ports else {}

    def stop(self, pulled: Mapping[str, int] | None = None) -> tuple[dict[str, int], str | None]:
        """``({port: bytes moved}, warning or None)`` since :meth:`start`; ``pulled``: ``{GPU
        address: bytes it pulled over NIXL since start()}`` for this process's GPUs (a GPU
        receiver: its own), which the funnel check needs."""
        if not self.ports:
            return {}, None
        moved = traffic(self._before, port_bytes(self.ports, self.root))
        warnings = [funnelled(moved, self.served, pulled or {}),
                    unbalanced(moved, [k for k in self.expected if moved.get(k)])]
        return moved, "; ".join(w for w in warnings if w) or None


__all__ = ["FUNNEL_SHARE", "NicMeter", "funnelled", "port_bytes", "traffic", "unbalanced"]
