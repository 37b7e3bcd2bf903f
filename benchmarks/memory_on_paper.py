"""On paper: GPU memory one vLLM worker needs for its weights plus a staged or a streamed refit.

    python benchmarks/memory_on_paper.py [--json docs/memory_on_paper.jsonl]
    python benchmarks/memory_on_paper.py --from-json docs/memory_on_paper.jsonl   # the table only

For each case, megarefit plans the worker's own shards (``plan_megatron_to_vllm``: its
tensor-parallel slices and its experts, in the served dtype) from the real HF config and
counts, in bytes:

- ``share``: the worker's weights (what vLLM holds, and what a refit moves into it);
- staged extra: the receiver's arena (the whole share) plus its scratch (5% of the share,
  at least 64 MiB: the receiver's default);
- streamed extra: the memory budget (ring + scratch), ``"auto"`` (the larger of 1 GiB and a
  ring holding the two largest layers) and a fixed 1 GiB where the largest layer fits it;
- ``largest layer``: the biggest group of one layer's tensors (the least a streamed ring holds).

Nothing is allocated: the plans are built on CPU from shapes. vLLM's own reload adds one
materialized module (its largest, at most a layer's MoE experts) to either refit; KV cache
and activations come on top of all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
H100 = 80 * 2**30  # bytes of an 80 GB H100 (HBM3, 80 GiB)

CASES = [  # name, config, served dtype / quantization, Megatron source layout, vLLM worker
    {"name": "Qwen3-235B-A22B bf16, vLLM tp8", "config": "Qwen3-235B-A22B.json", "quantization": None,
     "source": {"tp": 4, "ep": 8}, "target": {"tp": 8, "rank": 0}},
    {"name": "DeepSeek-V3 block FP8, vLLM tp8 x dp2, EP16", "config": "DeepSeek-V3.json", "quantization": "fp8",
     "source": {"tp": 8, "ep": 16}, "target": {"tp": 8, "rank": 0, "dp": 2, "dp_rank": 0, "expert_parallel": True}},
    {"name": "DeepSeek-V3 block FP8, vLLM tp16 (EP off)", "config": "DeepSeek-V3.json", "quantization": "fp8",
     "source": {"tp": 8, "ep": 16}, "target": {"tp": 16, "rank": 0}},
]


def measure(case: dict) -> dict:
    from megarefit import ModelDims, SourceLayout
    from megarefit.layout.dims import load_hf_config
    from megarefit.online.receiver.stream import GiB, default_memory_budget, layer_runs, target_bytes
    from megarefit.quant.fp8 import resolve_quantization
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg = dict(load_hf_config(str(ROOT / "tests/data/configs" / case["config"])))
    dims = ModelDims.from_hf_config(cfg)
    src = case["source"]
    layout = SourceLayout.build(tp=src["tp"], pp=1, ep=src["ep"], padded_vocab_size=dims.padded_vocab_size(src["tp"]),
                                num_layers=dims.num_layers)
    quant = resolve_quantization(case["quantization"], cfg) if case["quantization"] else None
    plan = plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(**case["target"]), quantization=quant)
    staging = plan.staging
    share = sum(target_bytes(plan, r) for r in plan.targets if r not in staging)
    staged_extra = share + max(64 << 20, share // 20)
    largest = max(sum(target_bytes(plan, r) for r in refs) for _, refs in layer_runs(plan))
    auto = default_memory_budget(plan)
    return {"case": case["name"], "share_bytes": share, "largest_layer_bytes": largest,
            "staged_extra_bytes": staged_extra, "auto_budget_bytes": auto,
            "one_gib_fits": largest <= GiB - GiB // 8, "gpu_bytes": H100}


def table(rows: list[dict]) -> str:
    """The markdown table (as printed, and as docs/benchmarks.md shows it)."""
    lines = [("| worker | weights GB | largest layer GB | staged: weights + extra GB | streamed auto: weights + "
             "budget GB | streamed 1 GiB GB | free of 80 GiB, staged / auto |"),
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        w, gpu = r["share_bytes"], r["gpu_bytes"]
        staged, auto = w + r["staged_extra_bytes"], w + r["auto_budget_bytes"]
        one = f"{(w + 2**30) / GB:.1f}" if r["one_gib_fits"] else "layer > ring"
        lines.append(f"| {r['case']} | {w / GB:.1f} | {r['largest_layer_bytes'] / GB:.2f} | {staged / GB:.1f} "
                     f"| {auto / GB:.1f} | {one} | {(gpu - staged) / GB:.1f} / {(gpu - auto) / GB:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here (JSON lines)")
    ap.add_argument("--from-json", default=None, help="print the table of recorded rows (a --json file)")
    ns = ap.parse_args(argv)
    if ns.from_json:
        rows = [json.loads(line) for line in Path(ns.from_json).read_text().splitlines() if line.strip()]
    else:
        rows = []
        for case in CASES:
            print(f"planning {case['name']} ...", file=sys.stderr, flush=True)
            rows.append(measure(case))
    if ns.json:
        Path(ns.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
