"""A raw NIXL READ between two processes of an emulated cluster (tests/cluster.py), as a script run
inside a node (``ip netns exec``):

    python tests/cluster_nixl.py serve DIR NBYTES SEED   # registers NBYTES seeded bytes, serves until DIR/done
    python tests/cluster_nixl.py read DIR REPEATS TIMEOUT  # READs them REPEATS times

Both use megarefit's :class:`~megarefit.transport.nixl_agent.NixlAgent` (UCX backend); the
server's agent metadata and block address travel through files in DIR (the namespaces share
the file system). The reader writes ``DIR/read.json`` (``{"seconds": [per READ], "nbytes"}``)
and ``DIR/received.pt`` (the bytes of the last READ); a READ not done within TIMEOUT seconds,
or one that fails, exits 3 with the reason on stderr (the agent's state, never a hang).
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


if __name__ == "__main__":
    role, d = sys.argv[1], Path(sys.argv[2])
    if role == "serve":
        serve(d, int(sys.argv[3]), int(sys.argv[4]))
    else:
        read(d, int(sys.argv[3]), float(sys.argv[4]))
