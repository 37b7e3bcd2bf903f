"""Warm refit in one process against the strict baseline: one contiguous copy of the same bytes.

Random Megatron shards of the planned shapes live on ``--device``; every path writes
preallocated buffers on that device and is timed ``--repeat`` times (after one cold call),
synchronising the device around each call. Paths, for the same bytes:

* ``one contiguous copy``: ONE ``copy_`` of ``plan.nbytes`` bytes (the strict baseline);
* ``_foreach_copy_ of the shards``: every source shard the plan reads, one batched call;
* ``copy_ per shard (Python loop)``: the same shards, one ``copy_`` each (the old, flattering baseline);
* ``megarefit warm refit``: ``run_refit_cycle(plan, LocalTransport(shards), buffers=...)``.

    python benchmarks/bench_warm.py --device cuda --config tests/data/configs/Qwen3-8B.json --tp 2 \\
        --json docs/warm_refit_h100.jsonl
    python benchmarks/bench_warm.py --from-json docs/warm_refit_h100.jsonl [--summary]

Ratios are median over median, baseline time over path time (1.00x: as fast as the baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BASE = "one contiguous copy"


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"


def _case(r: dict) -> str:
    ep = f" ep={r['ep']}" if r["ep"] > 1 else ""
    return f"{r['config']} {r['layers']} layers tp={r['tp']}{ep}"


def ratio(r: dict, path: str) -> float:
    """Median of the baseline over median of ``path`` in one record."""
    return statistics.median(r["samples"][BASE]) / statistics.median(r["samples"][path])


def table(records: list[dict]) -> str:
    """Markdown: one row per case, median (min-max) per path and the refit's ratio to each baseline."""
    head = records[0]
    paths = list(head["samples"])
    lines = [f"{head['machine']}, {head['date']}, {head['device']}; median (min-max) of {len(head['samples'][BASE])} "
             "warm calls; ratios: median over median, baseline time / refit time", "",
             "| case | GB | " + " | ".join(paths) + f" | **refit vs {BASE}** | refit vs `_foreach_copy_` | "
             "refit vs per-shard loop |", "|---|---:|" + "---:|" * (len(paths) + 3)]
    for r in records:
        s = {k: statistics.median(v) for k, v in r["samples"].items()}
        refit = s["megarefit warm refit"]
        lines.append(f"| {_case(r)} | {r['bytes'] / 1e9:.2f} | " + " | ".join(_fmt(r["samples"][p]) for p in paths)
                     + f" | **{s[BASE] / refit:.2f}x** | {s['_foreach_copy_ of the shards'] / refit:.2f}x | "
                     f"{s['copy_ per shard (Python loop)'] / refit:.2f}x |")
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    """One sentence: the range of the refit's ratio to one contiguous copy, dense and MoE apart."""
    dense = [ratio(r, "megarefit warm refit") for r in records if r["ep"] == 1]
    moe = [ratio(r, "megarefit warm refit") for r in records if r["ep"] > 1]
    gpu = records[0]["machine"].rsplit("GPU ", 1)[-1]
    def span(v: list[float]) -> str:
        return f"{min(v):.2f}x" if f"{min(v):.2f}" == f"{max(v):.2f}" else f"{min(v):.2f}-{max(v):.2f}x"

    parts = [f"{span(dense)} (dense)" if dense else "", f"{span(moe)} (MoE)" if moe else ""]
    return (f"A warm in-process refit runs at {', '.join(p for p in parts if p)} of one contiguous device copy of "
            f"the same bytes (median of {len(records[0]['samples'][BASE])} warm calls, one {gpu}, "
            f"{records[0]['date']}).")


def measure(ns: argparse.Namespace) -> dict:
    import torch

    from megarefit.demo.bench import layout_for, machine, random_shards, time_each
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.transport.execute import run_refit_cycle
    from megarefit.transport.local import LocalTransport

    dims, layout = layout_for(ns.config, tp=ns.tp, ep=ns.ep, layers=ns.layers)
    plan = plan_megatron_to_hf(dims, layout, "bfloat16")
    shards = random_shards(plan, ns.device, torch.bfloat16)
    read = {op.src for op in plan.ops}
    src = [shards[r.rank][r.name] for r in plan.sources if r in read]
    flat_src = torch.ones(plan.nbytes, dtype=torch.uint8, device=ns.device)
    src_bytes = sum(t.numel() * t.element_size() for t in src)  # >= plan.nbytes (vocab padding is read whole)
    flat_dst = torch.empty(max(plan.nbytes, src_bytes + 16 * len(src)), dtype=torch.uint8, device=ns.device)
    dst, at = [], 0  # the per-shard destinations are views of the baseline's buffer (GPU memory)
    for t in src:
        n = t.numel() * t.element_size()
        dst.append(flat_dst[at:at + n].view(t.dtype).view(t.shape))
        at = (at + n + 15) // 16 * 16
    transport = LocalTransport(shards)
    buffers = {ref.name: torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=ns.device)
               for ref, meta in plan.targets.items()}

    def refit() -> None:
        for _ in run_refit_cycle(plan, transport, buffers=buffers):
            pass

    paths = {BASE: lambda: flat_dst[:plan.nbytes].copy_(flat_src),
             "_foreach_copy_ of the shards": lambda: torch._foreach_copy_(dst, src),
             "copy_ per shard (Python loop)": lambda: [d.copy_(s) for s, d in zip(src, dst)],
             "megarefit warm refit": refit}
    samples = {}
    for name, fn in paths.items():
        fn()  # cold
        samples[name] = time_each(fn, ns.repeat, ns.device)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device": ns.device, "config": Path(ns.config).stem, "layers": dims.num_layers, "tp": ns.tp,
            "ep": ns.ep, "bytes": plan.nbytes, "ops": len(plan.ops), "shards": len(src), "shard_bytes": src_bytes,
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tests/data/configs/Qwen3-8B.json")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="append the result as one JSON line")
    ap.add_argument("--from-json", help="print the table of recorded results (a --json file) and exit")
    ap.add_argument("--summary", action="store_true", help="with --from-json: one sentence, not the table")
    ns = ap.parse_args(argv)
    if ns.from_json:
        records = [json.loads(x) for x in Path(ns.from_json).read_text(encoding="utf-8").splitlines() if x.strip()]
        print(summary(records) if ns.summary else table(records))
        return 0
    if ns.repeat < 5:
        ap.error("--repeat must be at least 5 (median with min-max over at least 5 warm calls)")
    result = measure(ns)
    print(table([result]))
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
