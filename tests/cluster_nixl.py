"""A raw NIXL READ between two processes of an emulated cluster (tests/cluster.py), as a script run
inside a node (``ip netns exec``):

    python tests/cluster_nixl.py serve DIR NBYTES SEED   # registers NBYTES seeded bytes, serves until DIR/done
    python tests/cluster_nixl.py read DIR REPEATS TIMEOUT  # READs them REPEATS times
    python tests/cluster_nixl.py timeout DIR TIMEOUT       # one READ through NixlTransport.wait, which times out
    python tests/cluster_nixl.py quarantine DIR TIMEOUT    # the same, its memory quarantined, then fresh READs

Both use megarefit's :class:`~megarefit.transport.nixl_agent.NixlAgent` (UCX backend); the
server's agent metadata and block address travel through files in DIR (the namespaces share
the file system). The reader writes ``DIR/read.json`` (``{"seconds": [per READ], "nbytes"}``)
and ``DIR/received.pt`` (the bytes of the last READ); a READ not done within TIMEOUT seconds,
or one that fails, exits 3 with the reason on stderr (the agent's state, never a hang). ``timeout``
posts the READ as megarefit's transport does (:meth:`~megarefit.transport.nixl.NixlTransport.start`
/ ``wait``), lets it time out, releases its request (what the failover's next prepare does) and
writes ``DIR/timeout.json``: the error, the bytes landed when ``wait`` raised, 2 s later (the
worker idle) and after 3 s of other READs (the worker progressing). ``quarantine`` lets it time
out the same way, hands its memory to the transport's quarantine
(:func:`~megarefit.transport.nixl.quarantine`), then READs the first 64 KiB again
into fresh memory through the same transport, sweeping the quarantine after each, until it frees
the held memory (at most 60 s), and
writes ``DIR/quarantine.json`` and ``DIR/received.pt`` (the fresh bytes).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from megarefit.transport.nixl_agent import NixlAgent


def block(nbytes: int, seed: int) -> torch.Tensor:
    """The served bytes: ``[nbytes]`` uint8 from ``seed`` (the test rebuilds them as its oracle)."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def serve(d: Path, nbytes: int, seed: int) -> None:
    data = block(nbytes, seed)
    agent = NixlAgent("cluster-server", progress_thread=True)
    agent.register([data])
    (d / "server.meta").write_bytes(agent.metadata)
    (d / "server.json").write_text(json.dumps({"addr": data.data_ptr(), "nbytes": nbytes}))
    deadline = time.monotonic() + 300
    while not (d / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {timeout}s: the server did not start")
        time.sleep(0.05)


def read(d: Path, repeats: int, timeout: float) -> None:
    _wait_file(d / "server.json", 120)
    info = json.loads((d / "server.json").read_text())
    nixl = NixlAgent("cluster-reader", progress_thread=False)
    agent = nixl.agent
    remote = agent.add_remote_agent((d / "server.meta").read_bytes())
    local = torch.zeros(info["nbytes"], dtype=torch.uint8)
    nixl.register([local])
    rh = agent.prep_xfer_dlist(remote, [(info["addr"], info["nbytes"], 0)], "DRAM")
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), info["nbytes"], 0)], "DRAM")
    handle = agent.make_prepped_xfer("READ", lh, [0], rh, [0])
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.perf_counter() - t0 > timeout:
                print(f"READ of {info['nbytes']} bytes from cluster-server not done within {timeout}s "
                      f"(state {state})", file=sys.stderr)
                sys.exit(3)
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            print(f"READ of {info['nbytes']} bytes from cluster-server failed (state ERR) after "
                  f"{time.perf_counter() - t0:.2f}s", file=sys.stderr)
            sys.exit(3)
        seconds.append(time.perf_counter() - t0)
    torch.save(local, d / "received.pt")
    (d / "read.json").write_text(json.dumps({"seconds": seconds, "nbytes": info["nbytes"]}))


def _one_read(d: Path, local: torch.Tensor, name: str):
    """A transport, its remote and a prepared READ of the served bytes' first ``local.numel()``
    bytes into ``local`` (registered here)."""
    from megarefit.layout import RankCoord
    from megarefit.transport.nixl import NixlTransport
    from megarefit.transport.nixl_requests import PreparedPlan, SourcePulls

    _wait_file(d / "server.json", 120)
    info = json.loads((d / "server.json").read_text())
    transport = NixlTransport(name)
    remote = transport.nixl.agent.add_remote_agent((d / "server.meta").read_bytes())
    return transport, remote, info, _prepared_read(transport, remote, info["addr"], local, PreparedPlan, SourcePulls,
                                                   RankCoord)


def _prepared_read(transport, remote, addr: int, local: torch.Tensor, prepared_plan, source_pulls, coord):
    agent = transport.nixl.agent
    transport.nixl.register([local])
    rh = agent.prep_xfer_dlist(remote, [(addr, local.numel(), 0)], "DRAM")
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), local.numel(), 0)], "DRAM")
    pulls = source_pulls(coord(0, 0, 0), "cluster-server", [], agent.make_prepped_xfer("READ", lh, [0], rh, [0]),
                         dlists=(rh, lh))
    return prepared_plan(("cluster-read", local.data_ptr()), [pulls])


def quarantine_read(d: Path, timeout: float) -> None:
    from megarefit.layout import RankCoord
    from megarefit.transport.nixl import quarantine
    from megarefit.transport.nixl_agent import TransferError
    from megarefit.transport.nixl_requests import PreparedPlan, SourcePulls

    _wait_file(d / "server.json", 120)
    nbytes = json.loads((d / "server.json").read_text())["nbytes"]
    local = torch.zeros(nbytes, dtype=torch.uint8)  # the served bytes are never all zero
    transport, remote, info, prepared = _one_read(d, local, "cluster-reader")
    out: dict = {}
    try:
        transport.wait(transport.start(prepared), timeout=timeout, grace=0.0)
    except TransferError as exc:
        out["error"] = str(exc)
    out["held"] = quarantine(transport, [local])
    out["late_after"], out["held_now"] = transport.late, transport.quarantined.nbytes
    out["sweep_at_once"] = transport.quarantined.sweep()  # the READ is still running: nothing freed
    out["landed"] = int((local != 0).sum())
    fresh = torch.zeros(1 << 16, dtype=torch.uint8)
    again = _prepared_read(transport, remote, info["addr"], fresh, PreparedPlan, SourcePulls, RankCoord)
    t0, sweeps = time.monotonic(), []
    while time.monotonic() - t0 < 60.0 and not any(sweeps):  # fresh READs: the worker progresses
        transport.wait(transport.start(again), timeout=30.0)
        sweeps.append(transport.quarantined.sweep())
    out["sweeps"], out["landed_after_progress"] = sweeps, int((local != 0).sum())
    out["registered_after"] = transport.nixl.registered(local)
    torch.save(fresh, d / "received.pt")
    (d / "quarantine.json").write_text(json.dumps(out))


def timeout_read(d: Path, timeout: float) -> None:
    from megarefit.layout import RankCoord
    from megarefit.transport.nixl import NixlTransport
    from megarefit.transport.nixl_agent import TransferError
    from megarefit.transport.nixl_requests import PreparedPlan, SourcePulls, release_requests

    _wait_file(d / "server.json", 120)
    info = json.loads((d / "server.json").read_text())
    transport = NixlTransport("cluster-reader")
    agent = transport.nixl.agent
    remote = agent.add_remote_agent((d / "server.meta").read_bytes())
    local = torch.zeros(info["nbytes"], dtype=torch.uint8)  # the served bytes are never all zero
    transport.nixl.register([local])
    rh = agent.prep_xfer_dlist(remote, [(info["addr"], info["nbytes"], 0)], "DRAM")
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), info["nbytes"], 0)], "DRAM")
    pulls = SourcePulls(RankCoord(0, 0, 0), "cluster-server", [], agent.make_prepped_xfer("READ", lh, [0], rh, [0]),
                        dlists=(rh, lh))
    prepared = PreparedPlan(("cluster-timeout",), [pulls])
    out: dict = {}
    try:  # no grace: what NIXL does with a READ released while it runs
        transport.wait(transport.start(prepared), timeout=timeout, grace=0.0)
    except TransferError as exc:
        out["error"], out["rank"] = str(exc), exc.rank
    out["late"] = transport.late
    try:  # the transport knows its buffers may still be written: it posts nothing more
        transport.start(prepared)
        out["refused"] = None
    except TransferError as exc:
        out["refused"] = str(exc)
    try:  # NIXL: releasing an active transfer "will attempt to cancel it", else returns an error
        pulls.handle.release()
        out["release_error"] = None
    except Exception as exc:  # noqa: BLE001 -- recorded for the test
        out["release_error"] = repr(exc)
    pulls.handle = None
    release_requests([prepared], [])  # its descriptor lists
    out["landed"] = int((local != 0).sum())
    time.sleep(2.0)  # no progress on the worker meanwhile
    out["landed_2s_later"] = int((local != 0).sum())
    other = torch.zeros(1 << 16, dtype=torch.uint8)  # then other READs (the worker progresses) for 3 s
    transport.nixl.register([other])
    oh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(other.data_ptr(), other.numel(), 0)], "DRAM")
    small = agent.prep_xfer_dlist(remote, [(info["addr"], other.numel(), 0)], "DRAM")
    handle, t0, reads = agent.make_prepped_xfer("READ", oh, [0], small, [0]), time.monotonic(), 0
    while time.monotonic() - t0 < 3.0:
        agent.transfer(handle)
        while agent.check_xfer_state(handle) not in ("DONE", "ERR"):
            time.sleep(0.001)
        reads += 1
    out["landed_after_progress"], out["other_reads"] = int((local != 0).sum()), reads
    (d / "timeout.json").write_text(json.dumps(out))


if __name__ == "__main__":
    role, d = sys.argv[1], Path(sys.argv[2])
    if role == "serve":
        serve(d, int(sys.argv[3]), int(sys.argv[4]))
    elif role == "timeout":
        timeout_read(d, float(sys.argv[3]))
    elif role == "quarantine":
        quarantine_read(d, float(sys.argv[3]))
    else:
        read(d, int(sys.argv[3]), float(sys.argv[4]))
