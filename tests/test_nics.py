"""NIC selection per GPU and per-NIC byte accounting (megarefit.transport.nics) on sysfs trees
built from published server topologies (tests/data/sysfs, provenance in each file and in its
README). The expected GPU -> NIC pairs are the ones the published ``nvidia-smi topo -m``
matrices show (PIX / PXB affinity), not derived from megarefit's scoring."""

from __future__ import annotations

import logging

import pytest
from sysfs_fixtures import SPECS, add_traffic, build, dev_of, load

from megarefit.transport import nics

TOPOLOGIES = sorted(p.stem for p in SPECS.glob("*.json"))


@pytest.fixture(params=TOPOLOGIES)
def machine(request, tmp_path):
    spec = load(request.param)
    return spec, build(spec, tmp_path / "sys")


def _address(spec: dict, name: str) -> str:
    return next(d["pci"] for d in spec["devices"] if d["name"] == name)


def test_each_gpu_gets_the_nic_its_published_topology_pairs_it_with(machine):
    spec, root = machine
    gpus = nics.gpus(str(root))
    ports = nics.rdma_ports(str(root), dev=str(dev_of(root)))
    assert [g.address for g in gpus] == sorted(d["pci"] for d in spec["devices"] if d["kind"] == "gpu")
    chosen = nics.assign(gpus, ports)
    got = {gpu: (c.port.device if c.port else None) for gpu, c in chosen.items()}
    want = {_address(spec, g): n for g, n in spec["expected_pairs"].items()}
    if not any(want.values()):  # no RDMA NIC: nothing set, and the line says so
        assert not ports and all(c.value is None and "no active RDMA NIC" in c.line() for c in chosen.values())
        return
    if "acceptable_pairs" in spec:  # the sources fix a set per GPU (GB200: the same socket's ConnectX-7s)
        ok = {_address(spec, g): set(ns) for g, ns in spec["acceptable_pairs"].items()}
        assert all(got[g] in ok[g] for g in ok), (spec["machine"], got)
    else:
        assert got == want, spec["machine"]
    used = [c.port.ucx_name for c in chosen.values() if c.port]
    assert len(set(used)) == len(used)  # one GPU per compute NIC: never funnelled (openucx/ucx#11680)
    storage = {d["name"] for d in spec["devices"] if d.get("role") not in (None, "compute")}
    assert not storage & {c.port.device for c in chosen.values() if c.port}


def test_every_process_of_a_node_makes_the_same_choice_and_says_why(machine, monkeypatch, caplog):
    spec, root = machine
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv(nics.ENV, raising=False)
    for gpu in (d for d in spec["devices"] if d["kind"] == "gpu"):
        choice = nics.choose(gpu["pci"], str(root), dev=str(dev_of(root)))
        assert choice == nics.assign(nics.gpus(str(root)), nics.rdma_ports(str(root), dev=str(dev_of(root))))[gpu["pci"]]
        line = choice.line()
        assert line.startswith(f"megarefit: GPU {gpu['pci']} -> ") and "\n" not in line
        if choice.port is not None:
            assert choice.value == f"{choice.port.device}:1" and ("PCIe" in line or "NUMA" in line), line
            with caplog.at_level(logging.INFO, logger="megarefit.transport.nics"), nics.net_devices(choice):
                import os

                assert os.environ["UCX_NET_DEVICES"] == choice.value  # what UCX reads as the agent starts
            assert "UCX_NET_DEVICES" not in os.environ  # put back afterwards
            assert line in caplog.text


def test_the_user_decides_when_they_say_so(tmp_path):
    spec = load("no_rdma_2x5090")
    root = str(build(spec, tmp_path / "sys"))
    gpu = spec["devices"][0]["pci"]
    kept = nics.choose(gpu, root, env={"UCX_NET_DEVICES": "mlx5_3:1"})
    assert kept.value is None and "set by the user: kept" in kept.line()
    given = nics.choose(gpu, root, env={nics.ENV: "mlx5_7:1,mlx5_8:1"})
    assert given.value == "mlx5_7:1,mlx5_8:1"
    assert nics.choose(gpu, root, env={nics.ENV: "none"}).value is None
    assert "not found" in nics.choose("0000:99:00.0", root, env={}).line()


def test_a_port_that_is_down_is_not_chosen(tmp_path):
    spec = load("no_rdma_2x5090")
    spec["devices"] += [
        {"kind": "nic", "name": "mlx5_0", "pci": "0000:01:00.1", "numa": 0, "bridges": ["0000:00:01.1"], "active": False},
        {"kind": "nic", "name": "mlx5_1", "pci": "0000:02:00.1", "numa": 0, "bridges": ["0000:00:01.2"]}]
    tree = build(spec, tmp_path / "sys")
    root, dev = str(tree), str(dev_of(tree))
    assert [p.device for p in nics.rdma_ports(root, dev=dev)] == ["mlx5_1"]
    assert {p.device for p in nics.rdma_ports(root, active_only=False, dev=dev)} == {"mlx5_0", "mlx5_1"}
    chosen = nics.assign(nics.gpus(root), nics.rdma_ports(root, dev=dev))
    assert {c.port.device for c in chosen.values()} == {"mlx5_1"}  # two GPUs, one NIC: both through it
    assert "no NIC shares" in chosen["0000:01:00.0"].why and "same PCIe root port" in chosen["0000:02:00.0"].why


def test_bytes_per_nic_and_a_warning_when_ucx_funnels(machine):
    """Counters count 4-byte words; traffic on half the NICs (ucx#11680's failure) is flagged,
    even traffic is not."""
    spec, root = machine
    ports = nics.rdma_ports(str(root), dev=str(dev_of(root)))
    chosen = [c.port.ucx_name for c in nics.assign(nics.gpus(str(root)), ports).values() if c.port]
    if len(chosen) < 2:
        pytest.skip(f"{spec['machine']}: fewer than two NICs in use")
    before = nics.port_bytes(ports, str(root))
    for name in chosen:
        add_traffic(root, name, sent=0, received=8 << 30)
    even = nics.traffic(before, nics.port_bytes(ports, str(root)))
    assert all(even[n] == 8 << 30 for n in chosen) and nics.unbalanced(even, chosen) is None
    before = nics.port_bytes(ports, str(root))
    for name in chosen[: len(chosen) // 2]:
        add_traffic(root, name, sent=4 << 20, received=16 << 30)
    funnelled = nics.traffic(before, nics.port_bytes(ports, str(root)))
    warning = nics.unbalanced(funnelled, chosen)
    assert warning is not None and "idle: " in warning and chosen[-1] in warning, warning


def test_a_cycle_meter_reads_the_nodes_ports_around_a_pull(tmp_path):
    """What a GPU receiver's pipeline does around each pull (``CycleStats.nic_bytes``): every
    active port's bytes, and the warning when the compute NICs carried unevenly; nothing to read
    (and no cost) on a host without RDMA ports."""
    root = build(load("dgx_h100"), tmp_path / "dgx")
    meter = nics.NicMeter(str(root), str(dev_of(root)))
    assert meter and len(meter.expected) == 8 and "mlx5_1:1" not in meter.expected  # storage NICs: not the GPUs'
    meter.start()
    for port in meter.expected:
        add_traffic(root, port, sent=1 << 20, received=2 << 30)
    moved, warning = meter.stop()
    assert warning is None and moved["mlx5_0:1"] == (1 << 20) + (2 << 30) and moved["mlx5_1:1"] == 0
    meter.start()
    add_traffic(root, "mlx5_0:1", sent=0, received=2 << 30)
    assert meter.stop()[1] is None  # one GPU pulled (or only one receiver on this node): nothing to compare
    meter.start()
    add_traffic(root, "mlx5_0:1", sent=0, received=4 << 30)
    add_traffic(root, "mlx5_3:1", sent=0, received=1 << 30)
    moved, warning = meter.stop()
    assert "mlx5_0:1 moved 4.29 GB, 1.60x the mean of 2 NICs" in warning, warning
    empty = nics.NicMeter(str(build(load("no_rdma_2x5090"), tmp_path / "none")))
    empty.start()
    assert not empty and empty.stop() == ({}, None)


def test_ports_this_process_cannot_open_are_not_chosen_and_ethernet_waits_for_no_infiniband(tmp_path):
    """A container sees the host's HCAs in sysfs without their /dev/infiniband/uverbs nodes: those
    are not pinned (UCX could not use them). An Ethernet port under a GPU's own PCIe switch does
    not beat the node's InfiniBand fabric."""
    spec = load("dgx_h100")
    for d in spec["devices"]:
        if d["name"] == "mlx5_0":
            d["openable"] = False
    tree = build(spec, tmp_path / "sys")
    root, dev = str(tree), str(dev_of(tree))
    ports = nics.rdma_ports(root, dev=dev)
    assert "mlx5_0" not in {p.device for p in ports} and len(ports) == sum(d["kind"] == "nic" for d in spec["devices"]) - 1
    gpu0 = next(d["pci"] for d in spec["devices"] if d["name"] == "GPU0")
    assert nics.assign(nics.gpus(root), ports)[gpu0].port.device != "mlx5_0"
    spec = load("no_rdma_2x5090")
    spec["devices"] += [
        {"kind": "nic", "name": "mlx5_0", "pci": "0000:01:00.1", "numa": 0, "bridges": ["0000:00:01.1"],
         "link_layer": "Ethernet"},
        {"kind": "nic", "name": "mlx5_1", "pci": "0000:03:00.0", "numa": 0, "bridges": ["0000:00:01.3"]}]
    tree = build(spec, tmp_path / "eth")
    chosen = nics.assign(nics.gpus(str(tree)), nics.rdma_ports(str(tree), dev=str(dev_of(tree))))
    assert {c.port.device for c in chosen.values()} == {"mlx5_1"}
