"""What sysfs says about a node's GPUs and RDMA ports: PCIe paths, NUMA nodes, port state and
rate, PCI ids and the PCI Vital Product Data (VPD) that marks NVSwitch management functions.

Read by :mod:`~megarefit.transport.nics` (which NIC each GPU reads through) and
:mod:`~megarefit.transport.nic_meter` (bytes per NIC). Nothing here chooses anything.

NVSwitch management functions: on HGX B200 / B300 boards the NVSwitches are not PCIe devices;
Fabric Manager and the NVLink subnet manager reach them through InfiniBand functions of a
ConnectX-7 bridge on the GPU baseboard. They look like any ConnectX-7 port (PCI id 15b3:1021,
an ACTIVE InfiniBand port), and Fabric Manager tells them apart by a vendor-specific VPD item
``SMDL=SW_MNG`` (NVIDIA Fabric Manager user guide, "NVIDIA HGX B200/B300 GPU baseboard").
The VPD is the binary image of PCI Local Bus 3.0 section 6.4 in the function's ``vpd`` file,
readable by root only::

    0x82 len16  identifier string        ("ConnectX7 mezz for ...")
    0x90 len16  read-only keywords       KK len8 data, ... ("PN", "SN", "V0".."VZ", "RV" checksum last)
    0x91 len16  read/write keywords      (optional)
    0x78        end tag

(lengths little-endian). Mellanox writes ``key=value`` items joined by ``:`` into its
vendor-specific keywords (``VA: MLX:MN=MLNX:CSKU=V2:...``); a function is an NVSwitch
management one when any keyword's value holds the item ``SMDL=SW_MNG``.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Literal

SYSFS = "/sys"
_PCI = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")  # domains past 0xffff behind Intel VMD
_NVIDIA = "0x10de"
_MELLANOX = "0x15b3"
_GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller (data-centre GPUs), VGA controller
BLUEFIELD_IDS = {"0xa2d2": "BlueField", "0xa2d6": "BlueField-2", "0xa2d9": "BlueField-3 Lx", "0xa2dc": "BlueField-3"}
"""PCI device ids (vendor 0x15b3) of BlueField DPUs' integrated ConnectX network functions
(``lspci -nn``: ``MT43244 BlueField-3 integrated ConnectX-7 network controller [15b3:a2dc]``)."""
SW_MNG = "SMDL=SW_MNG"
NicKind = Literal["nic", "bluefield", "nvswitch-management"]


@dataclass(frozen=True)
class PciDevice:
    """A PCI function: ``address`` (``0000:18:00.0``), ``path`` (the PCI addresses from the root
    port down to it, itself last) and ``numa`` (its NUMA node; -1 unknown)."""

    address: str
    path: tuple[str, ...]
    numa: int

    def shared(self, other: PciDevice) -> int:
        """How many upstream bridges (not the devices themselves) the two paths share: 0 across
        root ports (``nvidia-smi topo``: NODE / SYS / PHB), 1 under one root port, 2+ under one
        PCIe switch (PXB / PIX)."""
        n = 0
        for a, b in zip(self.path[:-1], other.path[:-1]):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device: ``device`` (``mlx5_0``), ``port`` (1), where it sits, its
    ``state`` (``ACTIVE``), ``rate_gbps`` (Gb/s), ``link_layer`` (``InfiniBand`` / ``Ethernet``),
    ``openable`` (this process can open its verbs device), ``kind`` (``nic``; ``bluefield``: a
    BlueField DPU's function, by PCI id; ``nvswitch-management``: VPD ``SMDL=SW_MNG``) and
    ``vpd_readable`` (False: the VPD exists but could not be read, e.g. not root)."""

    device: str
    port: int
    pci: PciDevice
    state: str
    rate_gbps: float
    link_layer: str
    openable: bool = True
    kind: NicKind = "nic"
    vpd_readable: bool = True

    @property
    def ucx_name(self) -> str:
        """How ``UCX_NET_DEVICES`` names it: ``mlx5_0:1``."""
        return f"{self.device}:{self.port}"

    @property
    def healthy(self) -> bool:
        """ACTIVE, and its verbs device can be opened by this process."""
        return self.state == "ACTIVE" and self.openable

    def health(self) -> str:
        """Why it is not healthy, in a few words (``DOWN``; ``not openable by this process``)."""
        if self.state != "ACTIVE":
            return self.state or "state unknown"
        return "ACTIVE" if self.openable else "not openable by this process (no /dev/infiniband/uverbs node)"


def read_text(path: str, default: str = "") -> str:
    """``path``'s stripped text, ``default`` where it cannot be read."""
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
    numa = read_text(os.path.join(real, "numa_node"), "-1")
    return PciDevice(path[-1] if path else os.path.basename(real), path, int(numa) if numa.lstrip("-").isdigit() else -1)


def gpus(root: str = SYSFS) -> list[PciDevice]:
    """The node's NVIDIA GPUs, by PCI address."""
    out = []
    for entry in sorted(glob.glob(os.path.join(root, "bus", "pci", "devices", "*"))):
        if read_text(os.path.join(entry, "vendor")) == _NVIDIA and read_text(os.path.join(entry, "class")).startswith(
                _GPU_CLASSES):
            out.append(pci_device(entry, root))
    return out


def parse_vpd(data: bytes) -> tuple[str, dict[str, str]]:
    """``(identifier string, {keyword: value})`` of a PCI VPD image (module docstring); ``RV`` /
    ``RW`` (checksum, free space) are left out, reading stops at the end tag.

    Raises:
        ValueError: a resource runs past the end of ``data``."""
    name, fields, i = "", {}, 0
    while i < len(data):
        tag = data[i]
        if not tag & 0x80:  # a small resource: item in bits 6:3, length in bits 2:0
            if tag >> 3 == 0x0F:  # the end tag
                break
            i += 1 + (tag & 0x07)
            continue
        length = int.from_bytes(data[i + 1:i + 3], "little")
        body = data[i + 3:i + 3 + length]
        if i + 3 > len(data) or len(body) < length:
            raise ValueError(f"VPD resource 0x{tag:02x} at byte {i} runs past the end ({len(data)} bytes)")
        if tag == 0x82:
            name = body.decode("ascii", "replace").strip()
        elif tag in (0x90, 0x91):
            fields.update(_keywords(body))
        i += 3 + length
    return name, fields


def _keywords(body: bytes) -> dict[str, str]:
    out, j = {}, 0
    while j + 3 <= len(body):
        key, length = body[j:j + 2].decode("ascii", "replace"), body[j + 2]
        if key not in ("RV", "RW"):
            out[key] = body[j + 3:j + 3 + length].decode("ascii", "replace").rstrip("\x00 ")
        j += 3 + length
    return out


def _kind(pci_dir: str) -> tuple[NicKind, bool]:
    """``(kind, vpd_readable)`` of the PCI function at ``pci_dir`` (see :class:`RdmaPort`)."""
    if read_text(os.path.join(pci_dir, "vendor")) != _MELLANOX:
        return "nic", True
    if read_text(os.path.join(pci_dir, "device")) in BLUEFIELD_IDS:
        return "bluefield", True
    try:
        with open(os.path.join(pci_dir, "vpd"), "rb") as f:
            _, fields = parse_vpd(f.read())
    except FileNotFoundError:  # no VPD capability
        return "nic", True
    except (OSError, ValueError):  # root-only (or malformed): we cannot tell
        return "nic", False
    marked = any(SW_MNG in value.split(":") for value in fields.values())
    return ("nvswitch-management" if marked else "nic"), True


def rdma_ports(root: str = SYSFS, active_only: bool = True, dev: str = "/dev") -> list[RdmaPort]:
    """The node's RDMA ports (``/sys/class/infiniband``), by device and port number. ``active_only``:
    only :attr:`RdmaPort.healthy` ones: ACTIVE, and with a verbs device (``<dev>/infiniband/uverbsN``)
    this process can open (a container often sees the host's HCAs in sysfs without their device
    nodes)."""
    out = []
    for dev_dir in sorted(glob.glob(os.path.join(root, "class", "infiniband", "*"))):
        openable = _openable(dev_dir, dev)
        if active_only and not openable:
            continue
        pci = pci_device(os.path.join(dev_dir, "device"), root)
        kind, vpd_readable = _kind(os.path.realpath(os.path.join(dev_dir, "device")))
        ports = [p for p in glob.glob(os.path.join(dev_dir, "ports", "*")) if os.path.basename(p).isdigit()]
        for port in sorted(ports, key=lambda p: int(os.path.basename(p))):
            state = read_text(os.path.join(port, "state")).split(":")[-1].strip()
            rate = re.match(r"\s*([\d.]+)", read_text(os.path.join(port, "rate"), "0"))
            item = RdmaPort(os.path.basename(dev_dir), int(os.path.basename(port)), pci, state,
                            float(rate.group(1)) if rate else 0.0, read_text(os.path.join(port, "link_layer")),
                            openable, kind, vpd_readable)
            if item.healthy or not active_only:
                out.append(item)
    return out


def _openable(dev_dir: str, dev: str) -> bool:
    """Whether the verbs device of RDMA device ``dev_dir`` exists under ``dev`` and may be opened."""
    verbs = glob.glob(os.path.join(dev_dir, "device", "infiniband_verbs", "uverbs*"))
    return any(os.access(os.path.join(dev, "infiniband", os.path.basename(v)), os.R_OK | os.W_OK) for v in verbs)


__all__ = ["BLUEFIELD_IDS", "NicKind", "PciDevice", "RdmaPort", "SW_MNG", "SYSFS", "gpus", "parse_vpd", "pci_device",
           "rdma_ports", "read_text"]
