"""Fan-out: one receiver reads the trainers, replicas mirror receivers (every party its own process).

    python benchmarks/bench_fanout.py [--config tests/data/configs/Qwen3-0.6B.json] [--replicas 1 2 4] [--fanout 1]

A chain of depth h, cut-through (default) vs store-and-forward, each tier started as soon as its
parent began (``--overlap``)::

    python benchmarks/bench_fanout.py --layers 4 --replicas 3 --fanout 1 --overlap --chunk-mb 16
    python benchmarks/bench_fanout.py --layers 4 --replicas 3 --fanout 1 --overlap --store-and-forward

On nvidia-h200-x2 (issue 13's layout: trainer on GPU 0 -> replica A on GPU 1 -> replica B
on GPU 0)::

    python benchmarks/bench_fanout.py --config tests/data/configs/Qwen3-8B.json --trainer-device cuda:0 \\
        --devices cuda:1 cuda:0 --replicas 1 2 --fanout 1

Trainer processes serve random shards through real Publishers (as in bench_nixl.py). A
first-tier ``RefitReceiver(replica_group=...)`` process reads them; ``n`` replica
processes (``ReplicaReceiver``, arranged by ``tree_parent`` with fan-out ``k``) mirror
their parents, tier by tier (the replicas of one tier at once). Per cycle and warm: seconds of the first tier, of the whole
fan-out, aggregate GB/s (every receiver's bytes / the whole), and the bytes read from the
trainers (the first tier's wire bytes: 1x the model whatever ``n``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def receiver_job(index: int, _world: int, _port: int, rdzv_port: int, names: list[str], parents: list[str | None],
                 devices: list[str], cycles: int, make_current: bool = False, cut_through: bool = True,
                 chunk_bytes: int = 64 << 20) -> list[dict]:
    """Receiver ``names[index]``: the first tier (no parent) or a replica of ``parents[index]``;
    runs ``cycles`` cycles when told (``go/<name>/<c>``), reports seconds and bytes."""
    from megarefit.online import RefitReceiver
    from megarefit.online.receiver.replica import ReplicaReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    device = devices[index % len(devices)]  # not made current (unless --make-current): megarefit guards its own
    if make_current and device.startswith("cuda"):
        torch.cuda.set_device(device)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job="bench")
    name, parent = names[index], parents[index]
    if parent is None:
        rx = RefitReceiver(rdzv, name=name, timeout=180, device=device, replica_group="bench")
    else:
        rx = ReplicaReceiver(rdzv, group="bench", parent=parent, name=name, timeout=180, device=device,
                             serve=True, cut_through=cut_through, chunk_bytes=chunk_bytes)
    out = []
    for c in range(cycles):
        rdzv.store.wait([rdzv.prefix + f"go/{name}/{c}"])
        t0 = time.perf_counter()
        for _ in (rx.run_refit_cycle(1) if parent is None else rx.run_refit_cycle()):
            pass
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        nbytes = rx.stats.bytes_moved if parent is None else rx.bytes_read
        wire = rx.stats.wire_bytes if parent is None else 0
        out.append({"seconds": seconds, "bytes": nbytes, "trainer_bytes": wire})
        rdzv.store.set(rdzv.prefix + f"done/{name}/{c}", "1")
    rdzv.store.wait([rdzv.prefix + "finish"])  # keep serving until every replica is through
    rx.close()
    return out


def _wait_odd(rdzv, tier: list[str]) -> None:
    """Until every receiver of ``tier`` began rewriting its arena (its replica sequence odd)."""
    from megarefit.online.receiver.arena import arena_key

    keys = [rdzv.prefix + arena_key("seq", "bench", m) for m in tier]
    while any(rdzv.store.add(k, 0) % 2 == 0 for k in keys):
        time.sleep(0.0005)


def print_recorded(path: str) -> None:
    """The table of a ``--json`` file: one row per recorded run, devices and current device said."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print("machine: " + "; ".join(sorted({r.get("machine", "not recorded") for r in rows})) + "\n")
    print("| receiver processes | replicas | first tier s | whole fan-out s | per receiver s (best, tier order) "
          "| bytes from trainers |")
    print("|---|---:|---:|---:|---|---:|")
    for r in sorted(rows, key=lambda r: (not r.get("make_current"), r["replicas"])):
        current = "device made current (`--make-current`)" if r.get("make_current") else "device **not** made current"
        if all(d == "cpu" for d in r["devices"].values()):
            current = "CPU processes"
        if "mode" in r:  # a chain or tree run: how replicas forwarded
            chunk = f", {r['chunk_bytes'] / (1 << 20):g} MiB chunks" if r["mode"] == "cut-through" else ""
            current += f"; {r['mode']}{chunk}, depth {r['depth']}" + (", tiers overlapped" if r["overlap"] else "")
        each = ", ".join(f"{name} ({r['devices'][name]}) {s:.4f}" for name, s in r["per_receiver_s"].items())
        print(f"| {current} | {r['replicas']} | {r['first_tier_s']:.4f} | {r['total_s']:.4f} | {each} | "
              f"{r['trainer_bytes'] / 1e9:.2f} GB |")


def main() -> None:
    from bench_nixl import _setup, trainer

    from megarefit.demo.bench import bench_config, machine
    from megarefit.demo.workers import start_workers
    from megarefit.online.receiver.replica import tree_parent
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--trainer-device", default="cpu")
    ap.add_argument("--devices", nargs="+", default=["cpu"], help="receiver devices, round robin by tier order")
    ap.add_argument("--make-current", action="store_true", help="each receiver process sets its device current")
    ap.add_argument("--store-and-forward", action="store_true",
                    help="replicas read only a whole parent (ReplicaReceiver(cut_through=False))")
    ap.add_argument("--chunk-mb", type=float, default=64.0, help="cut-through chunk size, MiB")
    ap.add_argument("--overlap", action="store_true",
                    help="start each tier as soon as its parents began their cycle (else once they ended)")
    ap.add_argument("--json", help="append one JSON line per replica count")
    ap.add_argument("--from-json", help="print the table of recorded results (a --json file) and exit")
    ns = ap.parse_args()
    if ns.from_json:
        print_recorded(ns.from_json)
        return
    cfg = bench_config(ns.config, ns.layers)
    args = {"tp": ns.tp, "ep": 1, "etp": 0, "expert_layout": "sequential", "vllm_tp": 0, "vllm_rank": 0,
            "vllm_ep": False, "dtype": "bfloat16", "trainer_device": ns.trainer_device, "quantization": "none",
            "param_buffer": True}
    _, layout, _ = _setup(cfg, args)
    print(f"machine: {machine()}")
    print(f"model: {Path(ns.config).stem}, trainer tp={ns.tp} on {ns.trainer_device}; receivers on {ns.devices}; "
          f"fan-out {ns.fanout}")
    print("| replicas | first tier s | whole fan-out s | receivers | aggregate GB/s | bytes from trainers "
          "| per receiver s (best, tier order) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for n in ns.replicas:
        ensure_job_secret()  # the trainer processes started below inherit it
        rdzv = Rendezvous.serve(job="bench")
        trainers = start_workers(trainer, world_size=len(layout.ranks()), args=(rdzv.port, cfg, args))
        names = ["tier1"] + [f"replica{i}" for i in range(n)]
        devices_of = {m: ns.devices[i % len(ns.devices)] for i, m in enumerate(names)}
        parents = [tree_parent(rdzv, "bench", name, ns.fanout) for name in names]
        group = start_workers(receiver_job, world_size=len(names),
                              args=(rdzv.port, names, parents, ns.devices, ns.cycles, ns.make_current,
                                    not ns.store_and_forward, int(ns.chunk_mb * (1 << 20))))
        depth = {"tier1": 0}
        for name, parent in zip(names[1:], parents[1:]):
            depth[name] = depth[parent] + 1
        tiers = [[m for m in names if depth[m] == d] for d in range(max(depth.values()) + 1)]
        totals, firsts = [], []
        for c in range(ns.cycles):
            t0 = time.perf_counter()
            for tier in tiers:  # tier by tier; the replicas of one tier pull at once
                for name in tier:
                    rdzv.store.set(rdzv.prefix + f"go/{name}/{c}", "1")
                if ns.overlap and tier != tiers[0]:  # the next tier starts once this one began (arenas odd)
                    _wait_odd(rdzv, tier)
                else:
                    rdzv.store.wait([rdzv.prefix + f"done/{name}/{c}" for name in tier])
                if tier == tiers[0]:
                    firsts.append(time.perf_counter() - t0)
            rdzv.store.wait([rdzv.prefix + f"done/{name}/{c}" for name in names])
            totals.append(time.perf_counter() - t0)
        rdzv.store.set(rdzv.prefix + "finish", "1")
        results = group.join(timeout=600)
        rdzv.mark_consumed(1)
        trainers.join(timeout=300)
        nbytes = sum(r[-1]["bytes"] for r in results)
        best = min(totals[1:] or totals)
        each = {name: min(c["seconds"] for c in r[1:] or r) for name, r in zip(names, results)}
        print(f"| {n} | {min(firsts[1:] or firsts):.4f} | {best:.4f} | {len(names)} | {nbytes / best / 1e9:.2f} | "
              f"{results[0][-1]['trainer_bytes'] / 1e9:.3f} GB | "
              f"{', '.join(f'{m} ({devices_of[m]}) {s:.4f}' for m, s in each.items())} |", flush=True)
        if ns.json:
            with open(ns.json, "a", encoding="utf-8") as f:
                f.write(json.dumps({"replicas": n, "fanout": ns.fanout, "depth": len(tiers) - 1,
                                    "mode": "store-and-forward" if ns.store_and_forward else "cut-through",
                                    "chunk_bytes": int(ns.chunk_mb * (1 << 20)), "overlap": ns.overlap, "first_tier_s": min(firsts[1:] or firsts),
                                    "total_s": best, "bytes": nbytes, "per_receiver_s": each, "devices": devices_of,
                                    "machine": machine(), "make_current": ns.make_current, "trainer_bytes": results[0][-1]["trainer_bytes"],
                                    "median_total_s": statistics.median(totals[1:] or totals)}) + "\n")


if __name__ == "__main__":
    main()
