"""Which RDMA NIC each GPU reads through, chosen from the PCIe topology in sysfs; bytes per NIC.

Across nodes a refit is bound by the NICs (a DGX H100 has eight 400 Gb/s compute NICs, one
under each GPU's PCIe switch, beside its storage NICs). Left alone, UCX picks the devices
itself, and a UCX regression once funnelled GPU RDMA onto 4 of 8 NICs (openucx/ucx#11680). So
before NIXL starts, megarefit reads sysfs and gives each agent one NIC, ``UCX_NET_DEVICES``:

* GPUs (NVIDIA, PCI class 0x0302 / 0x0300) and RDMA ports (``/sys/class/infiniband/*/ports/*``,
  active ones) are located by their PCIe path: the bridge addresses from the root port down
  (``realpath /sys/bus/pci/devices/<address>``) and their NUMA node;
* only ports of the compute fabric are candidates: the InfiniBand ones where the node has any
  (NVIDIA's reference nodes put storage and front-end traffic on Ethernet ports, e.g. a GB200
  tray's BlueField-3), else all; and only ports whose verbs device this process can open;
* every GPU of the node is paired with a NIC, best pairs first: the longest shared PCIe path
  (the same switch beats the same root port), then the same NUMA node, then the faster port,
  then address order;
  no NIC serves more than ``ceil(GPUs / NICs)`` GPUs, so the pairing is balanced and the
  same in every process of the node;
* one line per process says which NIC was chosen and why (:meth:`NicChoice.line`).

Overrides: ``UCX_NET_DEVICES`` already set is kept; ``MEGAREFIT_NET_DEVICES=<value>`` is used as
given (``none``: let UCX pick). Per-NIC bytes come from the port counters
(``counters/port_xmit_data`` / ``port_rcv_data``, in 4-byte words per the InfiniBand spec).
Tested on sysfs trees built from published topologies (tests/data/sysfs).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

SYSFS = "/sys"
ENV = "MEGAREFIT_NET_DEVICES"
_PCI = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")  # domains past 0xffff behind Intel VMD
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller (data-centre GPUs), VGA controller
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PciDevice:
    """A PCI function: ``address`` (``0000:18:00.0``), ``path`` (the PCI addresses from the root
    port down to it, itself last) and ``numa`` (its NUMA node; -1 unknown)."""

    address: str
    path: tuple[str, ...]
    numa: int

    def shared(self, other: PciDevice) -> int:
        """How many upstream bridges (not the devices themselves) the two paths share."""
        n = 0
        for a, b in zip(self.path[:-1], other.path[:-1]):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device: ``device`` (``mlx5_0``), ``port`` (1), where it sits, its
    ``state`` (``ACTIVE``), ``rate_gbps`` (Gb/s) and ``link_layer`` (``InfiniBand`` / ``Ethernet``)."""

    device: str
    port: int
    pci: PciDevice
    state: str
    rate_gbps: float
    link_layer: str

    @property
    def ucx_name(self) -> str:
        """How ``UCX_NET_DEVICES`` names it: ``mlx5_0:1``."""
        return f"{self.device}:{self.port}"


def _read(path: str, default: str = "") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return default


def pci_device(sysfs_path: str, root: str = SYSFS) -> PciDevice:
    """The PCI function behind ``sysfs_path`` (a ``/sys/bus/pci/devices/<address>`` entry or an
    RDMA device's ``device`` link), located by its resolved path under ``root``."""
    real = os.path.realpath(sysfs_path)
    path = tuple(part for part in real.split(os.sep) if _PCI.match(part))
    numa = _read(os.path.join(real, "numa_node"), "-1")
    return PciDevice(path[-1] if path else os.path.basename(real), path, int(numa) if numa.lstrip("-").isdigit() else -1)


def gpus(root: str = SYSFS) -> list[PciDevice]:
    """The node's NVIDIA GPUs, by PCI address."""
    out = []
    for entry in sorted(glob.glob(os.path.join(root, "bus", "pci", "devices", "*"))):
        if _read(os.path.join(entry, "vendor")) == _NVIDIA and _read(os.path.join(entry, "class")).startswith(
                _GPU_CLASSES):
            out.append(pci_device(entry, root))
    return out


def rdma_ports(root: str = SYSFS, active_only: bool = True, dev: str = "/dev") -> list[RdmaPort]:
    """The node's RDMA ports (``/sys/class/infiniband``), by device and port number. ``active_only``:
    ports whose state is ``ACTIVE`` and whose verbs device (``<dev>/infiniband/uverbsN``) this
    process can open: a container often sees the host's HCAs in sysfs without their device nodes."""
    out = []
    for dev_dir in sorted(glob.glob(os.path.join(root, "class", "infiniband", "*"))):
        if active_only and not _openable(dev_dir, dev):
            continue
        pci = pci_device(os.path.join(dev_dir, "device"), root)
        ports = [p for p in glob.glob(os.path.join(dev_dir, "ports", "*")) if os.path.basename(p).isdigit()]
        for port in sorted(ports, key=lambda p: int(os.path.basename(p))):
            state = _read(os.path.join(port, "state")).split(":")[-1].strip()
            rate = re.match(r"\s*([\d.]+)", _read(os.path.join(port, "rate"), "0"))
            item = RdmaPort(os.path.basename(dev_dir), int(os.path.basename(port)), pci, state,
                            float(rate.group(1)) if rate else 0.0, _read(os.path.join(port, "link_layer")))
            if item.state == "ACTIVE" or not active_only:
                out.append(item)
    return out


def _openable(dev_dir: str, dev: str) -> bool:
    """Whether the verbs device of RDMA device ``dev_dir`` exists under ``dev`` and may be opened."""
    verbs = glob.glob(os.path.join(dev_dir, "device", "infiniband_verbs", "uverbs*"))
    return any(os.access(os.path.join(dev, "infiniband", os.path.basename(v)), os.R_OK | os.W_OK) for v in verbs)


@dataclass(frozen=True)
class NicChoice:
    """What one GPU reads through: ``port`` (``None``: UCX picks) and ``why`` (one clause)."""

    gpu: str
    port: RdmaPort | None
    why: str
    value: str | None = None  # UCX_NET_DEVICES to set (None: leave the environment alone)

    def line(self) -> str:
        """The process's one line: ``megarefit: GPU 0000:18:00.0 -> mlx5_0:1 (...): why``."""
        if self.port is None:
            return f"megarefit: GPU {self.gpu} -> {self.value or 'UCX default'}: {self.why}"
        p = self.port
        return (f"megarefit: GPU {self.gpu} -> {p.ucx_name} ({p.rate_gbps:g} Gb/s {p.link_layer or 'RDMA'}, "
                f"{p.pci.address}): {self.why}")


def _why(gpu: PciDevice, port: RdmaPort) -> str:
    shared = gpu.shared(port.pci)
    numa = f"NUMA {gpu.numa}" if gpu.numa == port.pci.numa and gpu.numa >= 0 else \
        f"NUMA {port.pci.numa} (the GPU's: {gpu.numa})"
    if shared >= 2:
        return f"same PCIe switch (under {gpu.path[shared - 1]}), {numa}"
    if shared == 1:
        return f"same PCIe root port ({gpu.path[0]}), {numa}"
    return f"no NIC shares the GPU's PCIe path; {numa}"


def assign(gpu_list: Sequence[PciDevice], ports: Sequence[RdmaPort]) -> dict[str, NicChoice]:
    """Pair every GPU with a port (module docstring): ``{GPU address: NicChoice}``; without
    ports, every choice says so and sets nothing."""
    if not ports:
        return {g.address: NicChoice(g.address, None, "no active RDMA NIC: UCX picks its transports") for g in gpu_list}
    fabric = [p for p in ports if p.link_layer == "InfiniBand"]
    ports = fabric or ports  # an InfiniBand fabric: its ports only (Ethernet ones carry storage / front-end)
    cap = math.ceil(len(gpu_list) / len(ports))
    pairs = sorted(((g, p) for g in gpu_list for p in ports),
                   key=lambda gp: (-gp[0].shared(gp[1].pci), gp[0].numa != gp[1].pci.numa, -gp[1].rate_gbps,
                                   gp[0].address, gp[1].device, gp[1].port))
    load: dict[str, int] = {}
    out: dict[str, NicChoice] = {}
    for g, p in pairs:
        if g.address in out or load.get(p.ucx_name, 0) >= cap:
            continue
        load[p.ucx_name] = load.get(p.ucx_name, 0) + 1
        out[g.address] = NicChoice(g.address, p, _why(g, p), p.ucx_name)
    return out


def choose(gpu_address: str, root: str = SYSFS, env: Mapping[str, str] | None = None, dev: str = "/dev"
           ) -> NicChoice:
    """The NIC for the GPU at ``gpu_address`` (overrides first, see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("UCX_NET_DEVICES"):
        return NicChoice(gpu_address, None, "UCX_NET_DEVICES set by the user: kept")
    given = env.get(ENV, "auto")
    if given == "none":
        return NicChoice(gpu_address, None, f"{ENV}=none: UCX picks")
    if given != "auto":
        return NicChoice(gpu_address, None, f"{ENV}={given}", given)
    try:
        found = assign(gpus(root), rdma_ports(root, dev=dev))
    except (OSError, ValueError) as exc:  # an unusual sysfs: never stop an agent from starting, but say so
        log.warning("megarefit: no NIC chosen for GPU %s, UCX picks: could not read the PCIe topology under %s "
                    "(%s: %s); set %s to choose", gpu_address, root, type(exc).__name__, exc, ENV)
        return NicChoice(gpu_address, None, f"could not read the PCIe topology ({type(exc).__name__}: {exc}): UCX picks")
    if gpu_address not in found:
        return NicChoice(gpu_address, None, f"GPU {gpu_address} not found under {root}/bus/pci/devices: UCX picks")
    return found[gpu_address]


def gpu_address(device: object) -> str | None:
    """The PCI address of CUDA device ``device`` (``torch.device`` or index), else ``None``."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = device.index if isinstance(device, torch.device) else device
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:  # pragma: no cover - a torch without the PCI ids
        log.warning("megarefit: torch %s gives no PCI ids of CUDA devices: no NIC chosen, UCX picks (set %s "
                    "to choose)", torch.__version__, ENV)
        return None


@contextlib.contextmanager
def net_devices(choice: NicChoice | None) -> Iterator[None]:
    """``UCX_NET_DEVICES`` set to ``choice`` while a NIXL agent starts (UCX reads it then), and
    put back afterwards; logs the choice's line once per process and GPU."""
    if choice is None:
        yield
        return
    if choice.gpu not in _LOGGED:
        _LOGGED.add(choice.gpu)
        log.info(choice.line())
    if choice.value is None:
        yield
        return
    before = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = choice.value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = before


_LOGGED: set[str] = set()


def port_bytes(ports: Sequence[RdmaPort], root: str = SYSFS) -> dict[str, tuple[int, int]]:
    """``{mlx5_0:1: (bytes sent, bytes received)}`` from each port's counters (``port_xmit_data``
    and ``port_rcv_data`` count 4-byte words); a port without counters is left out."""
    out = {}
    for p in ports:
        base = os.path.join(root, "class", "infiniband", p.device, "ports", str(p.port), "counters")
        xmit, rcv = _read(os.path.join(base, "port_xmit_data")), _read(os.path.join(base, "port_rcv_data"))
        if xmit.isdigit() and rcv.isdigit():
            out[p.ucx_name] = (4 * int(xmit), 4 * int(rcv))
    return out


def traffic(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Bytes each port moved (sent + received) between two :func:`port_bytes` readings."""
    return {k: (after[k][0] - before[k][0]) + (after[k][1] - before[k][1]) for k in after if k in before}


def unbalanced(moved: Mapping[str, int], expected: Sequence[str], threshold: float = 1.5) -> str | None:
    """A warning when the ports in ``expected`` (those the GPUs were given) carried unevenly: the
    busiest over the mean by more than ``threshold``, or a port idle while others moved bytes;
    else ``None``."""
    loads = {k: moved.get(k, 0) for k in expected}
    total = sum(loads.values())
    if len(loads) < 2 or total == 0:
        return None
    mean = total / len(loads)
    busiest = max(loads, key=lambda k: loads[k])
    idle = sorted(k for k, v in loads.items() if v == 0)
    if loads[busiest] <= threshold * mean and not idle:
        return None
    return (f"NIC traffic unbalanced: {busiest} moved {loads[busiest] / 1e9:.2f} GB, {loads[busiest] / mean:.2f}x "
            f"the mean of {len(loads)} NICs" + (f"; idle: {', '.join(idle)}" if idle else "")
            + " (is UCX_NET_DEVICES set per process? openucx/ucx#11680)")


class NicMeter:
    """The node's RDMA port counters read around a cycle: ``start()``, then ``stop()`` gives the
    bytes each port moved meanwhile and :func:`unbalanced`'s warning over those of the ports the
    node's GPUs were given that moved bytes (the counters are the node's: a GPU that pulled
    nothing, or other traffic, must not read as funnelling; an idle NIC is not flagged here).
    Empty (and free) on a host without RDMA ports."""

    def __init__(self, root: str = SYSFS, dev: str = "/dev"):
        self.root = root
        self.ports = rdma_ports(root, dev=dev)
        self.expected = sorted({c.value for c in assign(gpus(root), self.ports).values() if c.value})
        self._before: dict[str, tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.ports)

    def start(self) -> None:
        self._before = port_bytes(self.ports, self.root) if self.ports else {}

    def stop(self) -> tuple[dict[str, int], str | None]:
        """``({port: bytes moved}, warning or None)`` since :meth:`start`."""
        if not self.ports:
            return {}, None
        moved = traffic(self._before, port_bytes(self.ports, self.root))
        return moved, unbalanced(moved, [k for k in self.expected if moved.get(k)])


__all__ = ["ENV", "NicMeter", "NicChoice", "PciDevice", "RdmaPort", "assign", "choose", "gpu_address", "gpus", "net_devices",
           "pci_device", "port_bytes", "rdma_ports", "traffic", "unbalanced"]
