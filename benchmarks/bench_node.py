"""Node-local dedup on the emulated cluster (issue 60): receivers of one node split what they all need.

Run from the repo root as root (network namespaces; ~3 min on 2 cores):

    python benchmarks/bench_node.py [--rate-mbit 300] [--receivers 4] [--per-node 2] [--versions 6] \\
        [--memory-budget BYTES] [--record docs/node_cpu.jsonl]
    python benchmarks/bench_node.py --from-json docs/node_cpu.jsonl   # print the recorded table
    python benchmarks/bench_node.py --layers 8 --intermediate-size 256 --memory-budget 11000000 \
        --record docs/node_streamed_cpu.jsonl   # streamed: a model of 8 layers, under its size

Measured in one run (tests/cluster_refit.py: Megatron-Core trainers dp 2 x tp 2 on CPU, one node
each, every copy serving; ``--receivers`` RefitReceivers of full HF tensors, ``--per-node`` on each
receiver node; NIXL over UCX TCP on ``--rate-mbit`` tbf-limited veths), twice: the same placement
without node groups, then with them (``RefitReceiver(node=per_node)``). Per run: the warm cycles
(every version after the first; from the first READ posted to the last same-host copy done), the
bytes into each receiver node's veth per cycle, what each receiver READ from the trainers and
copied from its mates, the same-host READ seconds, and the model: the busiest veth's bytes of a
cycle over its tbf rate, plus the slowest receiver's same-host READs, plus the per-cycle cost
beyond the wire calibrated on the run without node groups (its cycle less its busiest veth's
time); medians with ranges. ``--memory-budget``: streamed receivers (each serves a node arena
of its share; ring + scratch + node arena within the budget: their peak is recorded).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recorded import recorded_main  # noqa: E402


def _cycles(run, versions: int) -> list[float]:
    """Per warm version: first READ posted (done - pull, fence and copy seconds) to the last copy done."""
    return [max(r["done"][v] for r in run.receivers) - min(r["done"][v] - r["span_s"][v] for r in run.receivers)
            for v in range(2, versions + 1)]


def one(args: argparse.Namespace, dedup: bool) -> dict:
    """One run of the cluster refit, with or without node groups."""
    from cluster_refit import cluster_config, refit_on_cluster

    cfg = cluster_config()
    if args.layers is not None:
        cfg.update(num_hidden_layers=args.layers, intermediate_size=args.intermediate_size or cfg["intermediate_size"])
    run = refit_on_cluster(config=cfg, dp=2, tp=2, receivers=args.receivers, versions=args.versions, rate_mbit=args.rate_mbit,
                           per_node=args.per_node, dedup=dedup, memory_budget=args.memory_budget)
    warm = range(2, args.versions + 1)
    cycles = _cycles(run, args.versions)
    rx = {n: m["rx_bytes"] / args.versions for n, m in sorted(run.moved.items()) if n.startswith("r")}
    busiest = max(max(run.trainer_tx().values()) / args.versions, *rx.values())
    copies = [max(r["node_read_s"][v] for r in run.receivers) for v in warm]
    wire = busiest / (args.rate_mbit * 1e6 / 8)
    return {"dedup": dedup, "cycles_s": cycles, "median_s": statistics.median(cycles),
            "range_s": [min(cycles), max(cycles)], "node_rx_per_cycle": rx,
            "placed_per_receiver": run.receivers[0]["bytes"][args.versions],
            "read_per_receiver": statistics.median(r["wire"][v] for r in run.receivers for v in warm),
            "copied_per_receiver": statistics.median(r["node_bytes"][v] for r in run.receivers for v in warm),
            "copy_s": statistics.median(copies), "wire_s": wire,
            "peak_extra": max(r["peak_extra"][v] for r in run.receivers for v in range(1, args.versions + 1)),
            "fallbacks": sum(
                len(r["node_fallbacks"][v]) for r in run.receivers for v in range(1, args.versions + 1))}


def measure(args: argparse.Namespace) -> dict:
    import conftest  # noqa: F401  - the suite's job secret and worker start method, for the trainers

    return {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpus": os.cpu_count(),
            "versions": {p: version(p) for p in ("torch", "nixl", "megatron-core")},
            "rate_mbit": args.rate_mbit, "receivers": args.receivers, "per_node": args.per_node,
            "memory_budget": args.memory_budget, "layers": args.layers, "intermediate_size": args.intermediate_size,
            "cycles": args.versions, "runs": [one(args, False), one(args, True)]}


def print_table(rec: dict) -> None:
    n, budget = rec["per_node"], rec.get("memory_budget")
    how = "" if budget is None else f", streamed within memory_budget = {budget / 1e6:.2f} MB"
    if rec.get("layers") is not None:
        how = f" ({rec['layers']} layers, intermediate size {rec['intermediate_size']})" + how
    print(f"Emulated cluster, {rec['date']}, {rec['cpus']} CPUs: Megatron-Core trainers dp 2 x tp 2 (one node each, "
          f"every copy serving), {rec['receivers']} receivers of full HF tensors{how}, {n} per node; veths at "
          f"{rec['rate_mbit']:.0f} Mbit/s (tbf); {rec['cycles'] - 1} warm cycles each. W: bytes a receiver places; "
          f"S = W (every mate needs every piece); expected READ per receiver with node groups: W - (n-1)/n S.\n")
    print("| node groups | READ from trainers per receiver MB | copied from mates MB | into each receiver node's "
          "veth per cycle MB | busiest veth / rate s | same-host READs s | warm cycle, median (range) s | "
          "model s | cycle / model |")
    print("|---|---:|---:|---|---:|---:|---|---:|---:|")
    base = rec["runs"][0]
    fixed = base["median_s"] - base["wire_s"]  # the calibration: beyond the wire, without node groups
    for r in rec["runs"]:
        veths = ", ".join(f"{b / 1e6:.2f}" for b in r["node_rx_per_cycle"].values())
        faster = "" if not r["dedup"] else f" ({base['median_s'] / r['median_s']:.2f}x faster)"
        model = r["wire_s"] + r["copy_s"] + fixed
        print(f"| {'yes' if r['dedup'] else 'no'} | {r['read_per_receiver'] / 1e6:.2f} | "
              f"{r['copied_per_receiver'] / 1e6:.2f} | {veths} | {r['wire_s']:.3f} | {r['copy_s']:.3f} | "
              f"{r['median_s']:.3f} ({r['range_s'][0]:.3f}-{r['range_s'][1]:.3f}){faster} | "
              + (f"{model:.3f} | {r['median_s'] / model:.2f} |" if r["dedup"] else f"(calibrates: {fixed:.3f} s beyond "
                 "the wire) | - |"))
    w = rec["runs"][1]["placed_per_receiver"]
    print(f"\nW = {w / 1e6:.2f} MB; W - (n-1)/n S = {(w - (n - 1) / n * w) / 1e6:.2f} MB. "
          f"Node-mate fallbacks: {rec['runs'][1]['fallbacks']}.")
    if budget is not None:
        print("Peak ring + scratch (+ node arena) per receiver, MB: " + ", ".join(
            f"{'with' if r['dedup'] else 'without'} node groups {r['peak_extra'] / 1e6:.2f}" for r in rec["runs"])
            + f" (memory_budget {budget / 1e6:.2f}).")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=float, default=300.0)
    ap.add_argument("--receivers", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--memory-budget", type=int, default=None, help="bytes: streamed receivers")
    ap.add_argument("--layers", type=int, default=None, help="the model's layers (default: cluster_config's 2)")
    ap.add_argument("--intermediate-size", type=int, default=None, help="with --layers (default: cluster_config's)")
    recorded_main(ap, measure, print_table, argv)


if __name__ == "__main__":
    main()
