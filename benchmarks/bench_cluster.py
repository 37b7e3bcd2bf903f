"""The emulated multi-node cluster (tests/cluster.py): link calibration and a refit across nodes.

Run from the repo root as root (network namespaces; ~2 min on 2 cores):

    python benchmarks/bench_cluster.py [--rate-mbit 300] [--dp 2] [--tp 2] [--receivers 4] [--versions 4]
    python benchmarks/bench_cluster.py --from-json docs/cluster_cpu.jsonl   # print the recorded table

Measured in one run, appended to ``--out`` (docs/cluster_cpu.jsonl) as one record:

* ``link``: a raw NIXL READ (UCX TCP) of ``--read-mb`` MB between two nodes whose veths are
  tbf-limited to ``--rate-mbit``, ``--repeats`` times: MB/s and its efficiency vs the tbf rate
  (the link term a model of the cluster uses);
* ``refits``: tests/cluster_refit.py's refit (Megatron-Core trainers dp x tp, one node each, and
  ``--receivers`` RefitReceivers), ``--versions`` versions, twice in the same run: only copy 0 of
  each coordinate serving, then every data-parallel copy (issue 58): the warm cycles (every
  version after the first), the bytes each trainer veth sent per cycle, the cycle over the busiest
  veth's bytes at the measured link rate, and every copy's speed-up over copy 0 alone (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def calibrate(rate_mbit: float, nbytes: int, repeats: int) -> dict:
    """Raw NIXL READs of ``nbytes`` across one ``rate_mbit`` veth: seconds per READ and MB/s."""
    from cluster import cluster

    script = str(ROOT / "tests" / "cluster_nixl.py")
    with cluster(["server", "reader"], rate_mbit=rate_mbit) as c, tempfile.TemporaryDirectory() as d:
        server = c["server"].popen([sys.executable, script, "serve", d, str(nbytes), "5"])
        reader = c["reader"].popen([sys.executable, script, "read", d, str(repeats), "120"])
        if reader.wait(timeout=600) != 0:
            raise RuntimeError("the calibration READ failed (its stderr above)")
        Path(d, "done").touch()
        server.wait(timeout=60)
        seconds = json.loads(Path(d, "read.json").read_text())["seconds"][1:]  # the first READ connects
    rates = [nbytes / s / 1e6 for s in seconds]
    return {"nbytes": nbytes, "seconds": seconds, "mb_s": statistics.median(rates), "mb_s_range": [min(rates), max(rates)],
            "efficiency": statistics.median(rates) / (rate_mbit / 8)}


def refit(args: argparse.Namespace, link_mb_s: float, every_copy: bool) -> dict:
    from cluster_refit import refit_on_cluster

    run = refit_on_cluster(dp=args.dp, tp=args.tp, receivers=args.receivers, versions=args.versions,
                           rate_mbit=args.rate_mbit, every_copy=every_copy)
    per_cycle = {n: b / args.versions for n, b in sorted(run.trainer_tx().items())}
    busiest = max(per_cycle.values())
    cycles = run.warm_cycles()
    return {"warm_s": cycles, "median_warm_s": statistics.median(cycles), "range_warm_s": [min(cycles), max(cycles)],
            "cold_s": run.cycle_s(1), "trainer_bytes_per_cycle": per_cycle,
            "receiver_bytes_per_cycle": run.receivers[0]["bytes"][args.versions],
            "busiest_over_link_s": busiest / (link_mb_s * 1e6),
            "cycle_over_busiest": statistics.median(cycles) / (busiest / (link_mb_s * 1e6))}


def machine() -> dict:
    return {"machine": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "versions": {p: version(p) for p in ("torch", "nixl", "megatron-core")}}


def table(records: list[dict]) -> str:
    head = ("| date | cpus | tbf rate | raw NIXL READ per veth | efficiency | trainers | receivers | "
            "bytes per serving veth per cycle | warm cycle, median (range) | cycle / (busiest veth bytes / READ rate) "
            "| speed-up over copy 0 alone |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        link = r["link"]
        refits = r.get("refits") or {("every copy" if r.get("every_copy") else "copy 0"): r["refit"]}
        for who, rf in refits.items():
            serving = [b for b in rf["trainer_bytes_per_cycle"].values() if b > 1e6]
            faster = (f"{refits['copy 0']['median_warm_s'] / rf['median_warm_s']:.2f}x"
                      if who == "every copy" and "copy 0" in refits else "")
            rows.append(
                f"| {r['date']} | {r['cpus']} | {r['rate_mbit']:.0f} Mbit/s | {link['mb_s']:.1f} MB/s "
                f"({link['mb_s_range'][0]:.1f}-{link['mb_s_range'][1]:.1f}) | {link['efficiency']:.2f} | "
                f"dp{r['dp']} x tp{r['tp']}, {who} serves | {r['receivers']} | "
                f"{statistics.mean(serving) / 1e6:.1f} MB on {len(serving)} of {len(rf['trainer_bytes_per_cycle'])} | "
                f"{rf['median_warm_s']:.2f} s ({rf['range_warm_s'][0]:.2f}-{rf['range_warm_s'][1]:.2f}) | "
                f"{rf['cycle_over_busiest']:.2f} | {faster} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=float, default=300.0)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--read-mb", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "docs" / "cluster_cpu.jsonl"))
    ap.add_argument("--from-json", help="print the table of a recorded file and exit")
    args = ap.parse_args()
    if args.from_json:
        print(table([json.loads(line) for line in Path(args.from_json).read_text().splitlines() if line.strip()]))
        return
    import conftest  # noqa: F401  - the suite's job secret and worker start method, for the trainers

    link = calibrate(args.rate_mbit, int(args.read_mb * 1e6), args.repeats)
    rec = {"date": time.strftime("%Y-%m-%d"), **machine(), "rate_mbit": args.rate_mbit, "dp": args.dp, "tp": args.tp,
           "receivers": args.receivers, "versions": args.versions, "link": link,
           "refits": {"copy 0": refit(args, link["mb_s"], False), "every copy": refit(args, link["mb_s"], True)}}
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(table([rec]))


if __name__ == "__main__":
    main()
