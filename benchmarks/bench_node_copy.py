"""The same-host copy of node groups (issue 60): a node-mate's arena ranges READ over NIXL, against a raw copy.

    python benchmarks/bench_node_copy.py [--device cpu] [--mb 256] [--pieces 1 64 4096] [--repeats 10] \\
        [--record docs/node_copy_cpu.jsonl]
    python benchmarks/bench_node_copy.py --device cuda --record docs/node_copy_h200x2.jsonl   # two GPUs
    python benchmarks/bench_node_copy.py --from-json docs/node_copy_cpu.jsonl              # the recorded table

Two processes, as two receivers of one node: the first (``cuda:0``, or the host) serves an arena
of ``--mb`` MB as a node-group mate does (its NIXL metadata and arena record in the rendezvous,
sequence even: ``online/receiver/arena.py``); the second (``cuda:1``, or the host) copies it into
its own arena with :class:`~megarefit.online.receiver.node_copy.MateReader` (one READ of
``pieces`` byte ranges, the same bytes in all). Between the GPUs of one host NIXL's UCX backend
copies over CUDA IPC (NVLink); between CPU processes over shared memory. The baseline, in the
same run: a raw copy of the same bytes, one contiguous ``copy_`` (from ``cuda:0`` to ``cuda:1``:
a peer copy; on the host: a memcpy) in the reader's process. Per case: the READ's seconds alone
(``MateReader.read_s``, no waiting), median and range of ``--repeats``, GB/s, and the ratio to the
raw copy; every copied byte checked.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from recorded import recorded_main  # noqa: E402

GROUP = "node-bench"


def _device(kind: str, index: int) -> torch.device:
    return torch.device(f"cuda:{index}") if kind == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve_job(_rank: int, _world: int, _port: int, rdzv_port: int, job: str, args: dict) -> dict:
    """The serving mate: an arena of ``args['mb']`` MB of known bytes, served until told to stop."""
    from megarefit.online.receiver.arena import arena_key, publish_arena
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.transport.nixl_agent import NixlAgent

    device = _device(args["device"], 0)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    arena = torch.arange(int(args["mb"] * 1e6) // 4, dtype=torch.int32, device=device).view(torch.float32)
    nixl = NixlAgent("mate-server", device=device)
    nixl.register([arena])
    publish_arena(rdzv, GROUP, "mate-server", {"float32": arena}, [("arena", "float32", 0, (arena.numel(),))], 1,
                  nixl.metadata)
    rdzv.store.add(rdzv.prefix + arena_key("seq", GROUP, "mate-server"), 0)
    while not rdzv.store.check([rdzv.prefix + "stop"]):
        time.sleep(0.05)
    return {"nbytes": arena.numel() * 4}


def _ranges(nbytes: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` byte ranges covering ``nbytes`` (aligned to 256 bytes), in order."""
    step = -(-nbytes // pieces // 256) * 256
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


def read_job(_rank: int, _world: int, _port: int, rdzv_port: int, job: str, args: dict) -> dict:
    """The copying mate: every case's READs timed, then the raw copy of the same bytes."""
    from megarefit.online.receiver.node_copy import MateReader, RangeCopy
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.transport.nixl_agent import NixlAgent

    here = _device(args["device"], 1)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    nbytes = int(args["mb"] * 1e6) // 4 * 4
    mine = torch.empty(nbytes // 4, dtype=torch.float32, device=here)
    nixl = NixlAgent("mate-reader", device=here)
    nixl.register([mine])
    reader = MateReader(rdzv, nixl, group=GROUP, mate="mate-server", timeout=120)
    want = torch.arange(nbytes // 4, dtype=torch.int32, device=here)
    out: dict = {"nbytes": nbytes, "cases": {}}
    for pieces in args["pieces"]:
        copies = [RangeCopy("float32", o, n, o) for o, n in _ranges(nbytes, pieces)]
        seconds = []
        for _ in range(args["repeats"] + 1):  # the first READ connects
            mine.zero_()
            _sync(here)
            reader.read(copies, {"float32": mine}, 1)
            seconds.append(reader.read_s)
            assert torch.equal(mine.view(torch.int32), want), f"{pieces} ranges: bytes differ"
        out["cases"][str(pieces)] = seconds[1:]
    src = want.to(_device(args["device"], 0)).view(torch.float32)
    raw = []
    for _ in range(args["repeats"] + 1):
        _sync(src.device)
        t0 = time.perf_counter()
        mine.copy_(src)
        _sync(here)
        raw.append(time.perf_counter() - t0)
    out["raw"] = raw[1:]
    rdzv.put("stop", "1")
    return out


def measure(ns: argparse.Namespace) -> dict:
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous

    os.environ.setdefault("MEGAREFIT_JOB_SECRET", secrets.token_hex(32))  # both processes inherit it
    job = "node-copy-bench"
    rdzv = Rendezvous.serve(job=job)
    args = {"device": ns.device, "mb": ns.mb, "pieces": ns.pieces, "repeats": ns.repeats}
    server = start_workers(serve_job, world_size=1, args=(rdzv.port, job, args))
    reader = start_workers(read_job, world_size=1, args=(rdzv.port, job, args))
    got = reader.join(600)[0]
    server.join(120)
    rdzv.store.close()
    name = torch.cuda.get_device_name(0) if ns.device == "cuda" else platform.processor() or platform.machine()
    return {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "device": ns.device, "device_name": name,
            "cpus": os.cpu_count(), "versions": {p: version(p) for p in ("torch", "nixl")}, **got}


def print_table(rec: dict) -> None:
    gb = rec["nbytes"] / 1e9
    raw = statistics.median(rec["raw"])
    where = "cuda:0 -> cuda:1" if rec["device"] == "cuda" else "host -> host, another process"
    print(f"Same-host copy, {rec['date']}, {rec['device_name']} ({where}): {gb * 1e3:.0f} MB; raw copy "
          f"(one contiguous copy_ in the reader's process) {raw * 1e3:.2f} ms = {gb / raw:.1f} GB/s.\n")
    print("| ranges in one READ | MateReader READ, median (range) ms | GB/s | time / raw copy |")
    print("|---:|---|---:|---:|")
    for pieces, seconds in rec["cases"].items():
        med = statistics.median(seconds)
        print(f"| {pieces} | {med * 1e3:.2f} ({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}) | {gb / med:.1f} | "
              f"{med / raw:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mb", type=float, default=256.0)
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--repeats", type=int, default=10)
    recorded_main(ap, measure, print_table, argv)


if __name__ == "__main__":
    main()
