"""The emulated cluster (tests/cluster.py) and raw NIXL READs across its nodes.

Namespaces, veths and processes are made and removed (also on failure, SIGTERM and a SIGKILLed
run); a READ between two nodes is bit-exact, its bytes are on both nodes' veths and its rate
follows the veth's tbf rate; without ``UCX_TLS``/``UCX_NET_DEVICES`` the veth carries nothing
(UCX uses shared memory across namespaces); a link set down mid-READ, loss and delay; a READ
released after its timeout still lands once the worker progresses (what a failover must honour).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster import PREFIX, Cluster, ClusterError, make_cluster_fixture, namespaces, sweep_stale

pytest.importorskip("nixl")

HERE = Path(__file__).parent
SCRIPT = str(HERE / "cluster_nixl.py")
NBYTES = 6 << 20
cluster_of = make_cluster_fixture()


def _ours(pid: int) -> list[str]:
    return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{pid}-")]


def _veths_in_root() -> list[str]:
    return [line for line in subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout.splitlines()
            if "nic0" in line or "veth" in line]


def test_nodes_get_a_rate_limited_nic_in_the_benchmarking_range(cluster_of):
    c = cluster_of(["a", "b"], rates={"b": 100.0}, rate_mbit=200.0)
    assert set(_ours(os.getpid())) == {c["a"].spec.ns, c["b"].spec.ns, c.bridge_ns}
    for node, rate in ((c["a"], "200Mbit"), (c["b"], "100Mbit")):
        addr = node.ip_cmd("-j", "addr", "show", "dev", "nic0").stdout
        assert f'"local":"{node.ip}"' in addr and node.ip.startswith("198.18.")
        qdisc = subprocess.run(["ip", "netns", "exec", node.spec.ns, "tc", "qdisc", "show", "dev", "nic0"],
                               check=False, capture_output=True, text=True).stdout
        assert "tbf" in qdisc and f"rate {rate}" in qdisc, qdisc
    assert not _veths_in_root()  # both veth ends live in namespaces the cluster made


def test_everything_is_removed_afterwards_also_on_failure():
    with pytest.raises(ZeroDivisionError), Cluster(["x", "y"]) as c:
        proc = c["x"].popen(["sleep", "600"])
        1 / 0
    assert proc.poll() is not None
    assert not _ours(os.getpid()) and not _veths_in_root()


CHILD = """
import sys, time
sys.path.insert(0, {here!r})
import cluster
with cluster.cluster(["a", "b"]) as c:
    c["a"].popen(["sleep", "600"])
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_run_ended_by_a_signal_leaves_nothing(sig):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE))], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert len(_ours(child.pid)) == 3
        child.send_signal(sig)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    if sig == signal.SIGKILL:  # nothing ran in the child: the next cluster sweeps what it left
        assert len(_ours(child.pid)) == 3
        assert sorted(sweep_stale()) == sorted(f"{PREFIX}{child.pid}-{n}" for n in ("a", "b", "br"))
    assert not _ours(child.pid) and not _veths_in_root()


def test_a_clear_error_where_namespaces_cannot_be_made(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ClusterError, match="needs `ip`"):
        Cluster(["a"])


def _serve(node, d: Path, nbytes: int = NBYTES, *, env: bool = True):
    args = [sys.executable, SCRIPT, "serve", str(d), str(nbytes), "5"]
    return node.popen(args) if env else subprocess.Popen(["ip", "netns", "exec", node.spec.ns, *args])


def _read(node, d: Path, repeats: int, timeout: float, *, env: bool = True):
    args = [sys.executable, SCRIPT, "read", str(d), str(repeats), str(timeout)]
    proc = (node.popen(args, stderr=subprocess.PIPE, text=True) if env else
            subprocess.Popen(["ip", "netns", "exec", node.spec.ns, *args], stderr=subprocess.PIPE, text=True))
    _, err = proc.communicate(timeout=timeout * repeats + 120)
    (d / "done").touch()
    return proc.returncode, err


def _delta(before: dict, after: dict) -> dict:
    return {n: {k: after[n][k] - before[n][k] for k in ("tx_bytes", "rx_bytes")} for n in after}


def _expected(nbytes: int = NBYTES) -> torch.Tensor:
    sys.path.insert(0, str(HERE))
    from cluster_nixl import block

    return block(nbytes, 5)


def test_a_nixl_read_crosses_the_veth_bit_exact_at_its_rate(cluster_of, tmp_path):
    rate = 200.0  # Mbit/s: 25 MB/s
    c = cluster_of(["server", "reader"], rate_mbit=rate)
    before = c.counters()
    server = _serve(c["server"], tmp_path)
    rc, err = _read(c["reader"], tmp_path, 3, 60)
    assert rc == 0, err
    server.wait(timeout=30)
    assert torch.equal(torch.load(tmp_path / "received.pt"), _expected())
    moved = _delta(before, c.counters())
    reads = NBYTES * 3
    assert reads <= moved["server"]["tx_bytes"] <= reads * 1.15, moved  # the READs and their headers
    assert reads <= moved["reader"]["rx_bytes"] <= reads * 1.15, moved
    assert moved["reader"]["tx_bytes"] < reads * 0.1, moved  # requests and acks only
    seconds = sorted(json.loads((tmp_path / "read.json").read_text())["seconds"])
    rate_mb_s = NBYTES / seconds[1] / 1e6
    assert 0.3 * rate / 8 < rate_mb_s < 1.1 * rate / 8, (rate_mb_s, seconds)


def test_without_the_ucx_settings_the_veth_carries_nothing(cluster_of, tmp_path):
    """What the cluster's env guards against: UCX's shared memory across namespaces."""
    c = cluster_of(["server", "reader"], rate_mbit=200.0)
    before = c.counters()
    server = _serve(c["server"], tmp_path, env=False)
    rc, err = _read(c["reader"], tmp_path, 1, 60, env=False)
    assert rc == 0, err
    server.wait(timeout=30)
    assert torch.equal(torch.load(tmp_path / "received.pt"), _expected())
    moved = _delta(before, c.counters())
    assert moved["server"]["tx_bytes"] < NBYTES / 100, moved


def test_a_link_set_down_mid_read_is_a_clear_error_within_the_timeout(cluster_of, tmp_path):
    c = cluster_of(["server", "reader"], rate_mbit=40.0)  # 6 MB: 1.2 s a READ
    server = _serve(c["server"], tmp_path)
    reader_args = [sys.executable, SCRIPT, "read", str(tmp_path), "4", "8"]
    reader = c["reader"].popen(reader_args, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while c.counters()["reader"]["rx_bytes"] < NBYTES // 2:  # the first READ is under way
        assert time.monotonic() - t0 < 120, "the READ never started"
        time.sleep(0.05)
    c["server"].set_link(False)
    t_down = time.monotonic()
    _, err = reader.communicate(timeout=60)
    (tmp_path / "done").touch()
    server.wait(timeout=30)
    assert reader.returncode == 3, err
    assert "not done within 8.0s" in err or "failed (state ERR)" in err, err
    assert time.monotonic() - t_down < 8 + 10
    assert not (tmp_path / "received.pt").exists()  # nothing half-read is handed on


def test_a_read_released_after_its_timeout_still_lands_once_the_worker_progresses(cluster_of, tmp_path):
    """What a failover after a READ timeout must honour (a straggler; tests/test_cluster_refit.py):
    the READ's error names its rank, but releasing its request does not stop its bytes. Over UCX
    TCP (nixl 1.5.1) the rest of the READ lands in its target memory as soon as the receiver's
    worker progresses again (any later READ), seconds after the release: memory a timed-out READ
    targeted must not be reused or freed until that READ is done. Waited for with no grace
    (``NixlTransport.wait(grace=0)``), the transport then refuses every later pull, naming why."""
    nbytes = 24 << 20
    c = cluster_of(["server", "reader"], rate_mbit=20.0)  # 24 MB: ~10 s a READ
    server = _serve(c["server"], tmp_path, nbytes)
    reader = c["reader"].popen([sys.executable, SCRIPT, "timeout", str(tmp_path), "2"], stderr=subprocess.PIPE, text=True)
    _, err = reader.communicate(timeout=120)
    (tmp_path / "done").touch()
    server.wait(timeout=30)
    assert reader.returncode == 0, err
    got = json.loads((tmp_path / "timeout.json").read_text())
    assert "no completion after 2.0 s" in got["error"] and got["rank"] == [0, 0, 0], got
    assert "still in flight after timing out" in got["late"] and "pulls nothing more" in got["late"], got
    assert got["refused"] == got["late"], got  # every later pull through this transport refused, loudly
    assert got["release_error"] is None, got  # released without an error: NIXL reports no failed cancel
    assert 0 < got["landed"] < nbytes // 2, got  # a part had landed: the READ was under way
    assert got["landed_2s_later"] == got["landed"], got  # the worker idle: nothing moves
    assert got["landed_after_progress"] > nbytes * 0.9, got  # then the rest of the released READ lands


def test_memory_a_late_read_may_write_is_held_until_it_lands_and_fresh_reads_stay_exact(cluster_of, tmp_path):
    """The failover's way past a READ still in flight after its timeout (a link left down): its
    memory goes to the transport's quarantine, the transport pulls again into fresh memory only.
    The late READ then lands in the held memory, never in the fresh one, and the quarantine frees
    it (deregistered) once that READ is done, not before."""
    nbytes = 24 << 20
    c = cluster_of(["server", "reader"], rate_mbit=20.0)  # 24 MB: ~10 s a READ
    server = _serve(c["server"], tmp_path, nbytes)
    reader = c["reader"].popen([sys.executable, SCRIPT, "quarantine", str(tmp_path), "2"], stderr=subprocess.PIPE,
                               text=True)
    _, err = reader.communicate(timeout=120)
    (tmp_path / "done").touch()
    server.wait(timeout=30)
    assert reader.returncode == 0, err
    got = json.loads((tmp_path / "quarantine.json").read_text())
    assert "no completion after 2.0 s" in got["error"], got
    assert got["held"] == nbytes and got["late_after"] == "", got  # held, and the transport pulls again
    assert 0 < got["landed"] < nbytes // 2, got  # the READ was under way when it was quarantined
    assert got["landed_after_progress"] > nbytes * 0.99, got  # it landed later, whole, in the held memory
    assert got["sweep_at_once"] == 0 and got["held_now"] == nbytes, got  # not while the READ runs
    assert sum(got["sweeps"]) == nbytes and got["sweeps"][-1] == nbytes, got  # freed once, after it ended
    assert not got["registered_after"], got
    assert torch.equal(torch.load(tmp_path / "received.pt"), _expected(nbytes)[:1 << 16])  # the fresh READs: exact


def test_a_short_outage_slows_a_read_that_stays_bit_exact(cluster_of, tmp_path):
    """A burst of loss: the server's NIC down for 1 s mid-READ, then up (TCP retransmits)."""
    c = cluster_of(["server", "reader"], rate_mbit=100.0)  # 6 MB: 0.5 s a READ
    server = _serve(c["server"], tmp_path)
    reader = c["reader"].popen([sys.executable, SCRIPT, "read", str(tmp_path), "1", "30"], stderr=subprocess.PIPE,
                               text=True)
    t0 = time.monotonic()
    while c.counters()["reader"]["rx_bytes"] < NBYTES // 4:
        assert time.monotonic() - t0 < 120, "the READ never started"
        time.sleep(0.02)
    c["server"].outage(1.0)
    _, err = reader.communicate(timeout=60)
    (tmp_path / "done").touch()
    server.wait(timeout=30)
    assert reader.returncode == 0, err
    assert torch.equal(torch.load(tmp_path / "received.pt"), _expected())
    assert json.loads((tmp_path / "read.json").read_text())["seconds"][0] > 1.0


def test_netem_where_the_kernel_has_it_or_a_clear_error(cluster_of):
    c = cluster_of(["a"])
    try:
        c["a"].netem(loss_pct=1.0, delay_ms=5.0)
    except ClusterError as exc:
        assert "no netem qdisc" in str(exc) and "Node.outage" in str(exc)
    else:
        qdisc = subprocess.run(["ip", "netns", "exec", c["a"].spec.ns, "tc", "qdisc", "show", "dev", "nic0"],
                               check=False, capture_output=True, text=True).stdout
        assert "netem" in qdisc and "loss 1%" in qdisc, qdisc
