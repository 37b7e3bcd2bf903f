"""Plan time and op counts for full-size models at realistic trainer layouts (shapes only).

    python benchmarks/bench_plan.py

Each plan is built cold (cache cleared) three times, validated (exact cover)
inside the timing; best and median are reported.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import megarefit
from megarefit.bench import machine, time_cold_plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = [  # (config, layout kwargs)
    ("Llama-3.1-405B", dict(tp=8, pp=16, first_stage_layers=7, last_stage_layers=7)),
    ("DeepSeek-V3", dict(tp=8, pp=16, ep=64, etp=1, first_stage_layers=4, last_stage_layers=1, layer_spec="te",
                         expert_layout="te_grouped")),
    ("DeepSeek-V3", dict(tp=2, pp=16, ep=64, etp=1, first_stage_layers=4, last_stage_layers=1, layer_spec="local",
                         expert_layout="sequential")),
    ("Qwen3-235B-A22B", dict(tp=4, pp=16, ep=64, first_stage_layers=5, last_stage_layers=5,
                             expert_layout="te_grouped")),
    ("Qwen3-235B-A22B", dict(tp=4, pp=8, ep=32, etp=1, first_stage_layers=11, last_stage_layers=11,
                             expert_layout="te_grouped")),
]


def main() -> None:
    print(f"machine: {machine()}")
    print("| model | layout | source tensors | ops | contiguous | scratch | bytes | best s | median s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, kw in CASES:
        cfg = json.loads((ROOT / f"tests/data/configs/{name}.json").read_text())
        dims = megarefit.ModelDims.from_hf_config(cfg)
        layout = megarefit.SourceLayout.build(padded_vocab_size=dims.padded_vocab_size(kw["tp"]),
                                              num_layers=dims.num_layers, **kw)
        plan, times = time_cold_plan(dims, layout)
        s = plan.summary()["total"]
        desc = " ".join(f"{k}={v}" for k, v in kw.items() if k not in ("first_stage_layers", "last_stage_layers"))
        print(f"| {name} | {desc} | {len(plan.sources)} | {s['ops']} | {s['contiguous']} | {s['scratch']} | "
              f"{plan.nbytes / 1e9:.1f} GB | {min(times):.2f} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
