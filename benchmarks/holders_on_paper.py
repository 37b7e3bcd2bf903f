"""On paper: how evenly every trainer GPU serves when every copy serves (issue 58).

    python benchmarks/holders_on_paper.py [--json docs/holders_on_paper.jsonl]   # plan, sum, print
    python benchmarks/holders_on_paper.py --from-json docs/holders_on_paper.jsonl

For each model and GPU count (split 50/50: half train, half serve, as ``refit_on_paper.py``'s
layouts: trainer tp 8, ep up to 64, etp 1, every remaining factor data-parallel; vLLM engines of
``vllm_tp x vllm_dp`` workers, as many replicas as fit), every worker of one engine is planned
(``plan_megatron_to_vllm``, bf16), then each worker of each replica picks its holders
(:func:`megarefit.planner.holders.served_by_readers`, reader ``replica + replicas * worker``),
and the bytes every trainer GPU serves are summed. Reported: bytes per trainer GPU, the busiest
over the mean (the mean over every trainer GPU, idle ones included), and the same for today's
rule (only copy 0 serves, each tensor from its first holder), and the most trainer ranks one
receiver reads (it connects to and fences those: one copy's). Units: bytes in the JSON, GB
(1e9 bytes) in the table. Nothing is measured: planner bytes only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import refit_on_paper as paper  # noqa: E402

NAMES = ("DeepSeek-V3", "Kimi-K2", "GLM-5", "Qwen3-235B-A22B")
GPUS = (64, 256, 1024)


def layouts(name: str, gpus: int):
    """(dims, trainer layout, vLLM engine (tp, dp, ep), replicas) of a 50/50 split."""
    from megarefit import SourceLayout

    m = paper.MODELS[name]
    trainer = gpus // 2
    _, dims = paper._dims(m.config)
    ep = min(m.trainer_ep, trainer)
    layout = SourceLayout.build(tp=m.trainer_tp, pp=1, ep=ep, etp=1,
                                padded_vocab_size=dims.padded_vocab_size(m.trainer_tp),
                                num_layers=dims.num_layers, dp=trainer // m.trainer_tp)
    return dims, layout, (m.vllm_tp, m.vllm_dp, m.vllm_ep), (gpus - trainer) // m.engine


def case(name: str, gpus: int) -> dict:
    """Plan every worker of one engine and sum what each trainer GPU serves to every replica."""
    from megarefit.planner.holders import Reader, served_by_readers
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    t0 = time.perf_counter()
    dims, layout, (vtp, vdp, vep), replicas = layouts(name, gpus)
    workers = vtp * vdp
    spread: dict = {}
    first: dict = {}
    reads = 0  # the most trainer ranks one receiver reads (connects to and fences)
    for w in range(workers):
        target = VllmTarget(vtp, w % vtp, dp=vdp, dp_rank=w // vtp, expert_parallel=vep)
        plan = plan_megatron_to_vllm(dims, layout, "bfloat16", target)
        readers = [Reader.of(r, replicas, w, workers) for r in range(replicas)]
        got = served_by_readers(plan, readers)
        reads = max([reads] + [len(served_by_readers(plan, [r])) for r in readers[:2]])
        for rank, b in got.items():
            spread[rank] = spread.get(rank, 0) + b
        for rank, row in plan.summary()["per_rank"].items():
            first[rank] = first.get(rank, 0) + row["bytes"] * replicas
    gpus_t = gpus // 2
    total = sum(spread.values())
    assert total == sum(first.values()), "holder choice changed the bytes read"
    return {"model": name, "gpus": gpus, "trainer_gpus": gpus_t, "trainer": [layout.tp, layout.ep, layout.dp],
            "engine": [vtp, vdp, bool(vep)], "replicas": replicas, "bytes": total,
            "busiest": max(spread.values()), "mean": total / gpus_t, "serving": len(spread),
            "today_busiest": max(first.values()), "today_serving": len(first), "ranks_per_receiver": reads,
            "seconds": round(time.perf_counter() - t0, 2)}


def table(rows: list[dict]) -> str:
    out = ["| model | GPUs (train + serve) | trainer tp x ep, dp | vLLM engine x replicas | GB per refit "
           "| busiest / mean, every copy serving | GPUs serving | ranks one receiver reads | today: busiest / mean "
           "| today: GPUs serving |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tp, ep, dp = r["trainer"]
        vtp, vdp, vep = r["engine"]
        out.append(f"| {r['model']} | {r['trainer_gpus']} + {r['gpus'] - r['trainer_gpus']} | {tp} x {ep}, dp {dp} "
                   f"| tp{vtp} x dp{vdp}{' EP' if vep else ''} x {r['replicas']} | {r['bytes'] / 1e9:.1f} "
                   f"| {r['busiest'] / r['mean']:.3f} | {r['serving']} of {r['trainer_gpus']} "
                   f"| {r.get('ranks_per_receiver', '-')} "
                   f"| {r['today_busiest'] / r['mean']:.1f} | {r['today_serving']} of {r['trainer_gpus']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="append the rows to this JSON-lines file")
    ap.add_argument("--from-json", help="print the table of a recorded file, plan nothing")
    ap.add_argument("--models", nargs="*", default=list(NAMES))
    ap.add_argument("--gpus", nargs="*", type=int, default=list(GPUS))
    args = ap.parse_args(argv)
    if args.from_json:
        rows = [json.loads(line) for line in Path(args.from_json).read_text().splitlines() if line.strip()]
    else:
        rows = [case(n, g) for n in args.models for g in args.gpus]
        if args.json:
            with open(args.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
