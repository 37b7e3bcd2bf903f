"""What a declared parameter move costs: a warm re-registration cycle vs a warm cycle vs a cold first cycle.

Two real Megatron-Core trainer ranks (tp 2, gloo, CPU, Megatron-Core DDP with the distributed
optimizer's parameter buffers; tests/moved_jobs.py) serve a GPT over NIXL (UCX on loopback). Between
versions they cycle through: no move (the next receiver cycle is warm); verl's offload (the DDP
parameter buffers' storages resized to 0, taken by another allocation, re-allocated and refilled:
new addresses) on both ranks, declared with ``Publisher.moving()`` (the next cycle is a warm
re-registration cycle: new generation, manifest and NIXL metadata re-read for the moved ranks,
their READ requests prepared again, the plan and arenas kept); the same on rank 0 only (only its
requests are prepared again: ``transport.rank_prepares`` counts, per rank, each preparation). After each version a fresh receiver also pulls it (a
cold first cycle: discovery, planning, allocation, registration). Receiver seconds are wall time
of ``run_refit_cycle`` consumed whole, started once both ranks published the version; trainer seconds are ``MoveStats.seconds`` (the drop, the
registration and the republish on one rank).

    python benchmarks/bench_moved.py [--layers 4] [--hidden 256] [--pairs 8] [--record docs/moved_cpu.jsonl]
    python benchmarks/bench_moved.py --from-json docs/moved_cpu.jsonl    # the recorded table
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from recorded import recorded_main  # benchmarks/recorded.py: the script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _timed(receiver, version: int) -> float:
    t0 = time.perf_counter()
    for _ in receiver.run_refit_cycle(version):
        pass
    return time.perf_counter() - t0


def measure(ns) -> dict:
    from conftest import tiny_config  # the suite's job secret and worker start method too
    from moved_jobs import moved_trainer_job

    from megarefit.demo.bench import machine
    from megarefit.demo.workers import start_workers
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous

    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=ns.layers, hidden_size=ns.hidden,
                      intermediate_size=3 * ns.hidden, vocab_size=4096)
    steps = ["none", "offload", "offload-rank0"] * ns.pairs
    job = "bench-moved"
    rdzv = Rendezvous.serve(job=job)
    group = start_workers(moved_trainer_job, world_size=2, args=(rdzv.port, job, cfg, steps, False))
    receiver = RefitReceiver(rdzv, name=f"{job}-warm", timeout=120)
    times: dict[str, list[float]] = {"cold": [], "warm": [], "moved": [], "moved1": []}
    kinds = {"offload": "moved", "offload-rank0": "moved1", "none": "warm"}
    prepared: dict[str, set[tuple]] = {k: set() for k in times}  # per kind: the ranks prepared again, as seen
    bytes_pulled = 0
    try:
        for v in range(1, len(steps) + 2):
            kind = "cold" if v == 1 else kinds[steps[v - 2]]
            before = dict(receiver.transport.rank_prepares)
            if not rdzv.copies.wait_complete([0], v, 120):  # published by both ranks: time the pull alone
                raise RuntimeError(f"the trainers did not publish version {v}")
            seconds = _timed(receiver, v)
            if kind != "cold":
                times[kind].append(seconds)
            after = receiver.transport.rank_prepares
            prepared[kind].add(tuple(sorted(tuple(r) for r in after if after[r] != before.get(r, 0))))
            bytes_pulled = receiver.stats.bytes_moved
            fresh = RefitReceiver(rdzv, name=f"{job}-cold-{v}", timeout=120)
            times["cold"].append(_timed(fresh, v))
            fresh.close()
            plans = receiver.counters["plans_built"]
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
    finally:
        for v in range(1, len(steps) + 2):
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
        per_rank = group.join(600)
        receiver.close()
    moves = [m for r in per_rank for m in r["moves"]]
    if not all(m["republished"] and m["moved"] == m["served"] for m in moves):  # else "moved" timed no move
        raise RuntimeError(f"an offload left parameters where they were: {moves}")
    return {"cycles_s": {k: _stats(v) for k, v in times.items()},
            "prepared_again": {k: sorted(v) for k, v in prepared.items() if k != "cold"},
            "trainer_move_s": _stats([m["seconds"] for m in moves]),
            "moves": [[m["moved"], m["served"], m["republished"], m["seconds"]] for m in moves],
            "registered_bytes_per_rank": moves[0]["registered"], "served_tensors_per_rank": moves[0]["served"],
            "plans_built": plans, "bytes": bytes_pulled, "layers": ns.layers, "hidden": ns.hidden, "pairs": ns.pairs,
            "machine": machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def print_table(r: dict) -> None:
    c = r["cycles_s"]
    print(f"Refit cycle of a receiver pulling full HF tensors from 2 Megatron-Core trainer ranks (tp 2, "
          f"{r['layers']} layers, hidden {r['hidden']}, {r['served_tensors_per_rank']} tensors and "
          f"{r['registered_bytes_per_rank'] / 1e6:.1f} MB per rank; {r['bytes'] / 1e6:.1f} MB pulled per cycle) over "
          f"NIXL on loopback; median (min-max) of n cycles; {r['machine']}, {r['date']} (a 2-core machine shared "
          "with other jobs: the ranges are wide).\n")
    print("| cycle | what happens | ranks prepared again | seconds | x warm |")
    print("|---|---|---|---:|---:|")
    rows = [("warm", "no move: fence records, READs re-posted"),
            ("moved", ("after a declared verl offload of both ranks: their manifests and NIXL metadata re-read, "
                       "their READs prepared again")),
            ("moved1", ("after a declared verl offload of rank 0 only: its manifest and metadata re-read, its READs "
                        "prepared again, rank 1's kept")),
            ("cold", "a new receiver's first: discover, plan, allocate, register, prepare")]
    warm = c["warm"]["median"]
    for key, what in rows:
        s = c[key]
        seen = r["prepared_again"].get(key)
        ranks = "all" if seen is None else " / ".join(", ".join(".".join(map(str, rank[:3])) for rank in one) or "none"
                                                      for one in seen)
        print(f"| {key} (n={s['n']}) | {what} | {ranks} | {s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f}) | "
              f"{s['median'] / warm:.1f} |")
    t = r["trainer_move_s"]
    print(f"\nTrainer side, per rank and move (drop the stale NIXL regions, register the moved buffers, republish "
          f"the manifest): {t['median'] * 1e3:.2f} ms ({t['min'] * 1e3:.2f}-{t['max'] * 1e3:.2f}), n={t['n']}. "
          f"The warm receiver built {r['plans_built']} plan over all {r['pairs'] * 3 + 1} versions. Ranks as tp.pp.ep.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=8, help="(no move, both ranks move, rank 0 moves) triples of versions")
    recorded_main(ap, measure, print_table)


if __name__ == "__main__":
    main()
