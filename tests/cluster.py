"""An emulated multi-node cluster on one machine: one network namespace per node, a real network.

::

      node ns "mrc-<pid>-<i>"             bridge ns "mrc-<pid>-br"
    +----------------------+          +-------------------------+
    | nic0  198.18.0.<i+1> |--veth----| p<i> --+                |
    | (tbf: rate_mbit)     |          |        +-- br0 (bridge) |
    +----------------------+          | p<j> --+                |
                                      +-------------------------+

Each node has one "GPU NIC", ``nic0`` (a veth whose peer ``p<i>`` is a port of a bridge that lives in
its own namespace), an address in 198.18.0.0/15 (the benchmarking range, RFC 2544) and a ``tc
tbf`` rate limit on both ends (so the NIC is limited sending and receiving). Processes run inside
a node by ``ip netns exec`` (:meth:`Node.popen`) or, forked from the suite's worker server, by
entering its namespace first (:func:`enter`; see tests/cluster_jobs.py). Either way they get
``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=nic0`` (:meth:`Node.env`): without them UCX uses shared
memory between processes of one host, across namespaces too, and the veth carries nothing.

Every namespace (and so every veth) and every process inside one is removed by
:meth:`Cluster.close`: on exit of the ``with`` block, on failure, on SIGTERM or Ctrl-C
(:func:`cluster` installs the handlers), at interpreter exit, and, for a run that was SIGKILLed,
by the next run (:func:`sweep_stale`, which removes namespaces named after a pid that is gone).

Where namespaces cannot be made (no root / CAP_NET_ADMIN, no ``ip`` or ``tc``) :class:`Cluster`
raises :class:`ClusterError` naming the command and its stderr; the fixture fails, never skips.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "mrc-"  # every namespace this module makes: mrc-<pid>-<node>
NIC = "nic0"  # each node's GPU NIC (inside its namespace)
BRIDGE = "br0"
SUBNET = "198.18.0.0/15"
DEFAULT_RATE_MBIT = 300.0
CLONE_NEWNET = 0x40000000


class ClusterError(RuntimeError):
    """An emulated-cluster command failed: names the command, its exit code and stderr."""


def _run(args: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``args`` (an ``ip`` / ``tc`` command); raise :class:`ClusterError` on failure."""
    try:
        done = subprocess.run(list(args), check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{' '.join(args)}` could not run: {exc}") from exc
    if check and done.returncode:
        raise ClusterError(f"`{' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def _nsname(pid: int, node: str) -> str:
    return f"{PREFIX}{pid}-{node}"


def namespaces() -> list[str]:
    """Names of every network namespace on this host (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (only ones a cluster of ours started there)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete(ns: str) -> None:
    _kill_inside(ns)
    for _ in range(50):  # a killed process may hold the namespace for a moment
        if _run(["ip", "netns", "delete", ns], check=False).returncode == 0 or ns not in namespaces():
            return
        time.sleep(0.1)
    raise ClusterError(f"network namespace {ns} could not be deleted: `ip netns pids {ns}` says who holds it")


def sweep_stale() -> list[str]:
    """Delete namespaces this module made in runs whose process is gone (a SIGKILLed pytest);
    returns their names."""
    stale = []
    for ns in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-.*", ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete(ns)
            stale.append(ns)
    return stale


CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def enter(ns: str) -> None:
    """Move the calling process into network namespace ``ns`` as ``ip netns exec`` does: the
    namespace (``setns``), then a mount namespace of its own with ``/sys`` mounted afresh, so
    ``/sys/class/net`` shows the node's NIC (UCX reads it as its TCP transport starts). For a
    worker forked from a server outside it, before it starts threads or opens sockets.

    Raises:
        ClusterError: a ``setns``, ``unshare`` or ``mount`` call failed (its errno)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            raise ClusterError(f"entering {ns}: {what} failed: {os.strerror(ctypes.get_errno())}")

    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


@dataclass(frozen=True)
class NodeSpec:
    """What a process needs to live in a node (picklable: handed to worker jobs)."""

    name: str
    ns: str
    ip: str
    nic: str = NIC

    def env(self) -> dict[str, str]:
        """The environment a process in this node needs: UCX over TCP on this node's NIC only,
        gloo on it too."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.nic, "GLOO_SOCKET_IFNAME": self.nic}

    def enter(self) -> None:
        """:func:`enter` this node's namespace and set :meth:`env` in ``os.environ``."""
        enter(self.ns)
        os.environ.update(self.env())


@dataclass
class Node:
    """One node of a :class:`Cluster`: namespace ``spec.ns``, NIC ``nic0`` at ``spec.ip``."""

    spec: NodeSpec
    port: str  # the veth peer's name in the bridge namespace
    cluster: Cluster
    rate_mbit: float | None
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ip(self) -> str:
        return self.spec.ip

    def env(self) -> dict[str, str]:
        return self.spec.env()

    def ip_cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``ip -n <ns> args``."""
        return _run(["ip", "-n", self.spec.ns, *args], check=check)

    def popen(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``args`` inside this node (``ip netns exec``) with :meth:`env` added to ``env``
        (default: this process's environment); the cluster kills it on close."""
        full = {**(os.environ if env is None else env), **self.env()}
        proc = subprocess.Popen(["ip", "netns", "exec", self.spec.ns, *args], env=full, **kw)
        self.procs.append(proc)
        return proc

    def python(self, code: str, *args: str, **kw) -> subprocess.Popen:
        """:meth:`popen` of ``python -c code args`` (this interpreter)."""
        return self.popen([sys.executable, "-c", code, *args], **kw)

    def counters(self) -> dict[str, int]:
        """Bytes and packets through this node's NIC, ``{"tx_bytes", "rx_bytes", "tx_packets",
        "rx_packets", "tx_dropped"}`` (``ip -s -j link``)."""
        link = json.loads(self.ip_cmd("-s", "-j", "link", "show", "dev", self.spec.nic).stdout)[0]
        st = link["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"], "tx_packets": st["tx"]["packets"],
                "rx_packets": st["rx"]["packets"], "tx_dropped": st["tx"]["dropped"]}

    # ---- faults and rates -------------------------------------------------------------------
    def set_link(self, up: bool) -> None:
        """Set the NIC up or down (down mid-pull: a link failure)."""
        self.ip_cmd("link", "set", "dev", self.spec.nic, "up" if up else "down")

    def set_rate(self, rate_mbit: float | None) -> None:
        """Rate-limit the NIC both ways with ``tc tbf`` (None: no limit); a straggler is a node
        with a lower rate than the rest."""
        self.rate_mbit = rate_mbit
        for ns, dev in ((self.spec.ns, self.spec.nic), (self.cluster.bridge_ns, self.port)):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_mbit is not None:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *_tbf(rate_mbit)])

    def netem(self, *, loss_pct: float = 0.0, delay_ms: float = 0.0) -> None:
        """Replace the NIC's sending qdisc with ``tc netem`` (loss and delay) at its rate.

        Raises:
            ClusterError: the kernel has no netem (``CONFIG_NET_SCH_NETEM``; the 2-core CI
                machines have none): use :meth:`outage` for a burst of loss there."""
        args = ["netem"]
        if delay_ms:
            args += ["delay", f"{delay_ms}ms"]
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        if self.rate_mbit is not None:
            args += ["rate", f"{self.rate_mbit}mbit"]
        try:
            _run(["ip", "netns", "exec", self.spec.ns, "tc", "qdisc", "replace", "dev", self.spec.nic, "root", *args])
        except ClusterError as exc:
            raise ClusterError(f"{exc} (this kernel has no netem qdisc, CONFIG_NET_SCH_NETEM: use Node.outage "
                               "for a burst of loss)") from exc

    def outage(self, seconds: float) -> None:
        """Set the NIC down for ``seconds`` then up again: every packet in between is lost (TCP
        retransmits afterwards); works where the kernel has no netem."""
        self.set_link(False)
        try:
            time.sleep(seconds)
        finally:
            self.set_link(True)

    def kill(self) -> None:
        """SIGKILL every process inside this node."""
        _kill_inside(self.spec.ns)


def _tbf(rate_mbit: float) -> list[str]:
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))  # 10 ms of the rate (HZ-safe), >= 32 kB
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]


_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()


class Cluster:
    """Nodes ``names`` (each a namespace with one rate-limited NIC) on one bridge.

    ``rates``: Mbit/s per node name (None: no limit); nodes not named get ``rate_mbit``.
    Addresses: 198.18.0.1, .2, ... in the order of ``names``.

    Raises:
        ClusterError: a namespace, veth, bridge or qdisc could not be made (the message names
            the command); everything made so far is removed first.
    """

    def __init__(self, names: Sequence[str], *, rate_mbit: float | None = DEFAULT_RATE_MBIT,
                 rates: Mapping[str, float | None] | None = None):
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise ClusterError(f"the emulated cluster needs `{tool}` (iproute2): apt-get install iproute2")
        if len(set(names)) != len(names) or len(names) > 250:
            raise ClusterError(f"node names must be distinct and at most 250: {list(names)}")
        sweep_stale()
        self.pid = os.getpid()
        self.bridge_ns = _nsname(self.pid, "br")
        self.made: list[str] = []
        self.nodes: dict[str, Node] = {}
        _LIVE.add(self)
        try:
            self._make(names, rate_mbit, dict(rates or {}))
        except BaseException:
            self.close()
            raise

    def _make(self, names: Sequence[str], rate_mbit: float | None, rates: dict) -> None:
        self._netns(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        _run([*br, "link", "add", BRIDGE, "type", "bridge"])
        _run([*br, "link", "set", BRIDGE, "up"])
        for i, name in enumerate(names):
            spec = NodeSpec(name, _nsname(self.pid, name), f"198.18.0.{i + 1}")
            port = f"p{i}"
            self._netns(spec.ns)
            _run(["ip", "link", "add", NIC, "netns", spec.ns, "type", "veth", "peer", "name", port,
                  "netns", self.bridge_ns])
            _run([*br, "link", "set", port, "master", BRIDGE, "up"])
            for ns in (spec.ns, self.bridge_ns):  # no IPv6 chatter (DAD, solicitations) on the counters
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
            _run(["ip", "-n", spec.ns, "addr", "add", f"{spec.ip}/15", "dev", NIC])
            _run(["ip", "-n", spec.ns, "link", "set", NIC, "up"])
            _run(["ip", "-n", spec.ns, "link", "set", "lo", "up"])
            node = Node(spec, port, self, None)
            node.set_rate(rates.get(name, rate_mbit))
            self.nodes[name] = node

    def _netns(self, ns: str) -> None:
        try:
            _run(["ip", "netns", "add", ns])
        except ClusterError as exc:
            raise ClusterError(f"cannot make network namespace {ns} (the emulated cluster needs root or "
                               f"CAP_NET_ADMIN, and a kernel with network namespaces): {exc}") from exc
        self.made.append(ns)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def counters(self) -> dict[str, dict[str, int]]:
        """:meth:`Node.counters` of every node, by name."""
        return {name: node.counters() for name, node in self.nodes.items()}

    def close(self) -> None:
        """Kill every process started in a node, delete every namespace made (and so every
        veth). Safe to call again."""
        for node in self.nodes.values():
            for proc in node.procs:
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(timeout=10)
        errors = []
        for ns in reversed(self.made):
            try:
                _delete(ns)
            except ClusterError as exc:
                errors.append(str(exc))
        self.made.clear()
        _LIVE.discard(self)
        if errors:
            raise ClusterError("; ".join(errors))

    def __enter__(self) -> Cluster:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_all() -> None:
    """Close every live cluster of this process (at exit, on SIGTERM)."""
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.close()


atexit.register(close_all)


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """While inside: SIGTERM (and SIGINT, as KeyboardInterrupt already does) closes every live
    cluster before the process ends; the previous handlers come back afterwards."""
    def on_term(signum, frame):
        close_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def on_int(signum, frame):
        close_all()
        raise KeyboardInterrupt

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@contextlib.contextmanager
def cluster(names: Sequence[str], **kw) -> Iterator[Cluster]:
    """A :class:`Cluster` for a ``with`` block, closed afterwards whatever happens, SIGTERM included."""
    with cleanup_on_signals(), Cluster(names, **kw) as c:
        yield c


def make_cluster_fixture():
    """A pytest fixture factory: ``cluster_of(names, **kw)`` returns a :class:`Cluster` closed at
    the end of the test; it fails (never skips) where namespaces cannot be made."""
    import pytest

    @pytest.fixture
    def cluster_of():
        stack = contextlib.ExitStack()

        def make(names: Sequence[str], **kw) -> Cluster:
            try:
                return stack.enter_context(cluster(names, **kw))
            except ClusterError as exc:
                pytest.fail(f"the emulated cluster cannot be made on this machine: {exc}", pytrace=False)

        with stack:
            yield make

    return cluster_of


__all__ = ["Cluster", "ClusterError", "Node", "NodeSpec", "cleanup_on_signals", "close_all", "cluster", "enter",
           "make_cluster_fixture", "namespaces", "sweep_stale"]
