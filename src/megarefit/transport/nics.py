"""Which RDMA NIC each GPU reads through, chosen from the PCIe topology in sysfs.

Across nodes a refit is bound by the NICs (a DGX H100 or B200 has eight 400 Gb/s compute NICs,
one under each GPU's PCIe switch, beside its storage and management ports). Left alone, UCX
picks the devices itself, and a UCX regression once funnelled GPU RDMA onto 4 of 8 NICs
(openucx/ucx#11680). So before NIXL starts, megarefit reads sysfs
(:mod:`~megarefit.transport.nic_sysfs`) and gives each agent one NIC, ``UCX_NET_DEVICES``:

* the node's **compute NICs** (:func:`compute_ports`) are its RDMA ports less

  - NVSwitch management functions (VPD ``SMDL=SW_MNG``: the HGX B200 / B300 baseboard's
    ConnectX-7 bridge, which Fabric Manager drives),
  - Ethernet ports where the node has InfiniBand ones (NVIDIA's reference nodes carry storage
    and front-end traffic on Ethernet),
  - where some port sits under a GPU's PCIe root port or switch: the ports under none
    (storage cards, BlueField-3 storage / in-band ports in CPU slots),
  - else (no NIC on any GPU's PCIe path, a GB200 tray): BlueField functions, where other NICs
    remain (a GB200 tray's BlueField-3s carry storage and front-end traffic);

  a port that is down or that this process cannot open is still the compute NIC it was, it
  just serves nobody;
* every GPU of the node is paired with a **healthy** compute port, best pairs first: the
  longest shared PCIe path (the same switch beats the same root port), then the same NUMA
  node, then the faster port, then PCI address order; no port serves more than
  ``ceil(GPUs / healthy compute ports)`` GPUs, so the pairing is balanced and the same in
  every process of the node;
* a GPU whose own port (the compute port on its PCIe path) is down shares the best healthy
  one, NUMA-local first, and its line says so, logged at WARNING
  (:attr:`NicChoice.degraded`);
* one line per process says which NIC was chosen and why (:meth:`NicChoice.line`).

Overrides: ``UCX_NET_DEVICES`` already set is kept; ``MEGAREFIT_NET_DEVICES=<value>`` is used as
given (``none``: let UCX pick). Bytes per NIC: :mod:`~megarefit.transport.nic_meter`. Tested on
sysfs trees built from published topologies (tests/data/sysfs).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from megarefit.transport.nic_sysfs import SYSFS, PciDevice, RdmaPort, gpus, pci_device, rdma_ports

ENV = "MEGAREFIT_NET_DEVICES"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NicChoice:
    """What one GPU reads through: ``port`` (``None``: UCX picks) and ``why`` (one clause);
    ``degraded``: the GPU's own port is unusable and it shares another (``why`` names both)."""

    gpu: str
    port: RdmaPort | None
    why: str
    value: str | None = None  # UCX_NET_DEVICES to set (None: leave the environment alone)
    degraded: bool = False

    def line(self) -> str:
        """The process's one line: ``megarefit: GPU 0000:18:00.0 -> mlx5_0:1 (...): why``."""
        if self.port is None:
            return f"megarefit: GPU {self.gpu} -> {self.value or 'UCX default'}: {self.why}"
        p = self.port
        return (f"megarefit: GPU {self.gpu} -> {p.ucx_name} ({p.rate_gbps:g} Gb/s {p.link_layer or 'RDMA'}, "
                f"{p.pci.address}): {self.why}")


def compute_ports(gpu_list: Sequence[PciDevice], ports: Sequence[RdmaPort]) -> tuple[list[RdmaPort], dict[str, str]]:
    """The node's compute ports, healthy or not (module docstring), and ``{port: why it is
    not one}`` for the others (``mlx5_0:1: NVSwitch management function (VPD SMDL=SW_MNG)``)."""
    mgmt = "NVSwitch management function (VPD SMDL=SW_MNG)"
    why = {p.ucx_name: mgmt for p in ports if p.kind == "nvswitch-management"}

    def prefer(kept: list[RdmaPort], among: list[RdmaPort], reason: str) -> list[RdmaPort]:
        """``kept`` where it holds any port (the others get ``reason``), else ``among``."""
        why.update({p.ucx_name: reason for p in among if kept and p not in kept})
        return kept or among

    left = [p for p in ports if p.kind != "nvswitch-management"]
    left = prefer([p for p in left if p.link_layer == "InfiniBand"], left,
                  "Ethernet, beside the node's InfiniBand ports (storage / front-end)")
    local = [p for p in left if any(g.shared(p.pci) >= 1 for g in gpu_list)]
    if local:
        return prefer(local, left, "under no GPU's PCIe root port or switch (storage / in-band management)"), why
    return prefer([p for p in left if p.kind != "bluefield"], left,
                  "BlueField function (storage / front-end), beside NICs that are not"), why


def _why(gpu: PciDevice, port: RdmaPort) -> str:
    numa = f"NUMA {gpu.numa}" if gpu.numa == port.pci.numa and gpu.numa >= 0 else \
        f"NUMA {port.pci.numa} (the GPU's: {gpu.numa})"
    return f"{_where(gpu, port)}, {numa}"


def _where(gpu: PciDevice, port: RdmaPort) -> str:
    shared = gpu.shared(port.pci)
    if shared >= 2:
        return f"same PCIe switch (under {gpu.path[shared - 1]})"
    if shared == 1:
        return f"same PCIe root port ({gpu.path[0]})"
    return "off the GPU's PCIe path"


def _preference(pair: tuple[PciDevice, RdmaPort]) -> tuple:
    g, p = pair
    return -g.shared(p.pci), g.numa != p.pci.numa, -p.rate_gbps, g.address, p.pci.address, p.port


def assign(gpu_list: Sequence[PciDevice], ports: Sequence[RdmaPort]) -> dict[str, NicChoice]:
    """Pair every GPU with a healthy compute port (module docstring): ``{GPU address: NicChoice}``.

    ``ports``: the node's ports in any state (``rdma_ports(active_only=False)``, so that a GPU
    whose own port is down is told so), or its healthy ones only. Without a healthy compute
    port, every choice says why and sets nothing (UCX picks)."""
    compute, excluded = compute_ports(gpu_list, ports)
    healthy = [p for p in compute if p.healthy]
    if not healthy:
        why = _none(ports, compute, excluded)
        return {g.address: NicChoice(g.address, None, why) for g in gpu_list}
    cap = math.ceil(len(gpu_list) / len(healthy))
    load: dict[str, int] = {}
    chosen: dict[str, RdmaPort] = {}
    for g, p in sorted(((g, p) for g in gpu_list for p in healthy), key=_preference):
        if g.address in chosen or load.get(p.ucx_name, 0) >= cap:
            continue
        load[p.ucx_name] = load.get(p.ucx_name, 0) + 1
        chosen[g.address] = p
    note = "" if all(p.vpd_readable for p in compute) else \
        "; VPD unreadable (not root): NVSwitch management functions told apart by PCIe position only"
    return {g.address: _choice(g, chosen, compute, note) for g in gpu_list}


def _choice(g: PciDevice, chosen: Mapping[str, RdmaPort], compute: Sequence[RdmaPort], note: str) -> NicChoice:
    """GPU ``g``'s choice, and whether its own (closer, unusable) compute port made it share."""
    p = chosen[g.address]
    closer = [q for q in compute if not q.healthy and g.shared(q.pci) > g.shared(p.pci)]
    if not closer:
        return NicChoice(g.address, p, _why(g, p) + note, p.ucx_name)
    own = max(closer, key=lambda q: g.shared(q.pci))
    others = sorted(a for a, q in chosen.items() if q.ucx_name == p.ucx_name and a != g.address)
    shares = f"sharing {p.ucx_name}" + (f" with GPU {', '.join(others)}" if others else "")
    down = f"its own NIC {own.ucx_name} at {own.pci.address}, {_where(g, own)}, is {own.health()}"
    return NicChoice(g.address, p, f"{down}: {shares}; {_why(g, p)}{note}", p.ucx_name, degraded=True)


def _none(ports: Sequence[RdmaPort], compute: Sequence[RdmaPort], excluded: Mapping[str, str]) -> str:
    if not ports:
        return "no active RDMA NIC: UCX picks its transports"
    if not compute:
        return f"no compute NIC ({'; '.join(f'{k}: {v}' for k, v in excluded.items())}): UCX picks its transports"
    return f"no healthy compute NIC ({', '.join(f'{p.ucx_name} {p.health()}' for p in compute)}): UCX picks"


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
        found = assign(gpus(root), rdma_ports(root, active_only=False, dev=dev))
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
    put back afterwards; logs the choice's line once per process and GPU (at WARNING where the
    choice is :attr:`~NicChoice.degraded`, else INFO)."""
    if choice is None:
        yield
        return
    if choice.gpu not in _LOGGED:
        _LOGGED.add(choice.gpu)
        log.log(logging.WARNING if choice.degraded else logging.INFO, choice.line())
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

__all__ = ["ENV", "NicChoice", "PciDevice", "RdmaPort", "assign", "choose", "compute_ports", "gpu_address", "gpus",
           "net_devices", "pci_device", "rdma_ports"]
