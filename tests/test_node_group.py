"""Node groups (issue 60): which receivers share a host, found through the rendezvous.

The identity is checked against the kernel from outside megarefit: a process in a new network
namespace (``unshare --net``, root) or a new IPC namespace gets another key, a process in the same
namespaces the same key, and the boot id is the one ``/proc`` gives. Groups: receivers joining one
real served rendezvous from threads and processes see the same members in the same order; a
group waits for the expected count and says who came; a full group refuses a newcomer; another
job's records are not read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megarefit.errors import MegarefitError
from megarefit.online import Rendezvous
from megarefit.online.receiver.node import NODE_ENV, join_node, node_identity
from megarefit.online.store.records import RendezvousTimeout

ROOT = Path(__file__).resolve().parents[1]
KEY = "from megarefit.online.receiver.node import node_identity; print(node_identity().key)"


def _key_in(*prefix: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != NODE_ENV}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([*prefix, sys.executable, "-c", KEY], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def _unshare(flag: str) -> list[str]:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("unshare needs root and util-linux")
    return ["unshare", flag]


def test_the_key_is_the_boot_id_and_namespaces_of_proc(monkeypatch):
    monkeypatch.delenv(NODE_ENV, raising=False)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    parts = [boot] + [f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}" for ns in ("ipc", "net")]
    assert node_identity().key == hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    assert node_identity().source == "kernel"
    assert _key_in() == node_identity().key  # another process in the same namespaces


@pytest.mark.parametrize("flag", ["--net", "--ipc"])
def test_a_process_in_another_namespace_is_on_another_node(flag):
    assert _key_in(*_unshare(flag)) != _key_in()


def test_the_environment_names_the_node_or_is_refused(monkeypatch):
    monkeypatch.setenv(NODE_ENV, "node-3")
    assert (node_identity().key, node_identity().source) == ("node-3", NODE_ENV)
    monkeypatch.setenv(NODE_ENV, "node 3/../x")
    with pytest.raises(MegarefitError, match=r"MEGAREFIT_NODE='node 3/\.\./x': give 1-64 characters"):
        node_identity()


@pytest.fixture
def store():
    rdzv = Rendezvous.serve("127.0.0.1", 0, job="nodes", secret="s" * 64)
    yield rdzv
    rdzv.store.close()


def _peer(store, job="nodes", secret="s" * 64):
    return Rendezvous.connect("127.0.0.1", store.port, job=job, secret=secret, timeout=30)


def test_mates_see_one_group_in_joining_order(store, monkeypatch):
    monkeypatch.setenv(NODE_ENV, "n0")
    identity = node_identity()
    groups: dict[str, object] = {}

    def join(rid: str) -> None:
        groups[rid] = join_node(_peer(store), rid, identity, expected=4, timeout=30)

    threads = [threading.Thread(target=join, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(groups) == ["r0", "r1", "r2", "r3"]
    order = [m.rid for m in groups["r0"].mates]
    assert sorted(order) == sorted(groups) and all([m.rid for m in g.mates] == order for g in groups.values())
    assert all(g.mates[g.index].rid == rid for rid, g in groups.items())
    assert store.members("node/n0") == order  # the store's own list, read directly

    again = join_node(_peer(store), order[2], identity, expected=4, timeout=5)  # restarted: its old place
    assert again.index == 2
    with pytest.raises(MegarefitError, match=r"receiver 'a9' joined a full group of 4"):  # sorts first: no matter
        join_node(_peer(store), "a9", identity, expected=4, timeout=5)


def test_a_group_short_of_mates_times_out_naming_who_came(store, monkeypatch):
    monkeypatch.setenv(NODE_ENV, "n1")
    join_node(_peer(store), "a", node_identity(), expected=1, timeout=5)
    with pytest.raises(RendezvousTimeout, match=r"node n1 \(MEGAREFIT_NODE\): 2 of 3 receivers joined within "
                                                r"0.5 s: \['a', 'b'\]"):
        join_node(_peer(store), "b", node_identity(), expected=3, timeout=0.5)
    with pytest.raises(MegarefitError, match="expected=0"):
        join_node(_peer(store), "c", node_identity(), expected=0)


def test_nodes_and_jobs_stay_apart(store, monkeypatch):
    monkeypatch.setenv(NODE_ENV, "n2")
    join_node(_peer(store), "x", node_identity(), expected=1)
    monkeypatch.setenv(NODE_ENV, "n3")
    assert [m.rid for m in join_node(_peer(store), "y", node_identity(), expected=1).mates] == ["y"]
    monkeypatch.setenv(NODE_ENV, "n2")  # the same store, another job: its node n2 is not this job's
    assert [m.rid for m in join_node(_peer(store, job="other"), "z", node_identity(), expected=1).mates] == ["z"]
    assert [m.rid for m in join_node(_peer(store), "x", node_identity(), expected=1).mates] == ["x"]
