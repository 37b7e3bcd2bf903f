"""Build a Linux sysfs tree (the parts NIC selection reads) from a topology spec in
tests/data/sysfs/*.json: each device under its PCIe bridge chain, ``bus/pci/devices`` links,
``class/infiniband`` devices with their ports and counters."""

from __future__ import annotations

import json
import os
from pathlib import Path

SPECS = Path(__file__).parent / "data" / "sysfs"


def load(name: str) -> dict:
    return json.loads((SPECS / f"{name}.json").read_text())


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def build(spec: dict, root: Path) -> Path:
    """The tree of ``spec`` under ``root`` (returned: pass it as ``root=`` to megarefit.transport.nics,
    and :func:`dev_of` as ``dev=``: each NIC's verbs device node, unless ``"openable": false``)."""
    for n, dev in enumerate(d for d in spec["devices"] if d["kind"] == "nic"):
        dev["uverbs"] = f"uverbs{n}"
    for dev in spec["devices"]:
        chain = dev.get("bridges", [])
        where = root / "devices" / f"pci{(chain[0] if chain else dev['pci'])[:7]}"
        for bridge in chain:
            where = where / bridge
        where = where / dev["pci"]
        _write(where / "numa_node", str(-1 if dev.get("numa") is None else dev["numa"]))
        vendor, device = (dev.get("pci_id") or ("10de:" if dev["kind"] == "gpu" else "15b3:")).split(":")
        _write(where / "vendor", f"0x{vendor}")
        if device:
            _write(where / "device", f"0x{device}")
        _write(where / "class", "0x030200" if dev["kind"] == "gpu" else "0x020700")
        if "vpd" in dev:  # binary, as the kernel's vpd attribute reads
            (where / "vpd").write_bytes(vpd_image(dev["vpd"]["name"], dev["vpd"]["fields"]))
        link = root / "bus" / "pci" / "devices" / dev["pci"]
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(where, link)
        if dev["kind"] == "nic":
            ib = root / "class" / "infiniband" / dev["name"]
            ib.mkdir(parents=True, exist_ok=True)
            os.symlink(where, ib / "device")
            (where / "infiniband_verbs" / dev["uverbs"]).mkdir(parents=True)
            if dev.get("openable", True):
                _write(dev_of(root) / "infiniband" / dev["uverbs"], "")
            for port in range(1, dev.get("ports", 1) + 1):
                p = ib / "ports" / str(port)
                _write(p / "state", "4: ACTIVE" if dev.get("active", True) else "1: DOWN")
                rate = dev.get("port_rate_gbps") or 400
                _write(p / "rate", f"{rate} Gb/sec (4X {_IB_SPEEDS.get(rate, 'NDR')})")
                _write(p / "link_layer", dev.get("link_layer") or "InfiniBand")
                _write(p / "counters" / "port_xmit_data", "0")
                _write(p / "counters" / "port_rcv_data", "0")
    return root


_IB_SPEEDS = {100: "EDR", 200: "HDR", 400: "NDR", 800: "XDR"}  # 4X link widths, as ibstat and sysfs name them


def vpd_image(name: str, fields: dict[str, str]) -> bytes:
    """A PCI VPD image (PCI Local Bus 3.0, section 6.4 and appendix I), written here from the
    spec and not by megarefit's reader: the identifier string (large resource 0x82), the
    read-only keywords (0x90: two ASCII letters, a length byte, the data) closed by ``RV``,
    whose first byte makes every byte from the start through it sum to 0 mod 256, then the
    end tag (small resource 0x78). Resource lengths are 16-bit little-endian."""
    ident = name.encode("ascii")
    head = bytes([0x82]) + len(ident).to_bytes(2, "little") + ident
    body = b"".join(k.encode("ascii") + bytes([len(v)]) + v.encode("ascii") for k, v in fields.items())
    reserved = 2  # RV: the checksum byte and one reserved byte
    ro_len = len(body) + 3 + reserved
    ro_head = bytes([0x90]) + ro_len.to_bytes(2, "little")
    before = head + ro_head + body + b"RV" + bytes([reserved])
    checksum = (-sum(before)) % 256
    return before + bytes([checksum]) + b"\x00" * (reserved - 1) + bytes([0x78])


def dev_of(root: Path) -> Path:
    """The ``/dev`` beside a built tree."""
    return root.parent / "dev"


def add_traffic(root: Path, port: str, sent: int, received: int) -> None:
    """Advance ``port``'s (``mlx5_0:1``) counters by ``sent`` / ``received`` bytes (4-byte words)."""
    device, number = port.split(":")
    base = root / "class" / "infiniband" / device / "ports" / number / "counters"
    for name, add in (("port_xmit_data", sent), ("port_rcv_data", received)):
        f = base / name
        f.write_text(f"{int(f.read_text()) + add // 4}\n")
