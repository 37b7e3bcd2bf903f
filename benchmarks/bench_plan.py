"""Plan time and op counts for full-size models at realistic trainer layouts (shapes only).

    python benchmarks/bench_plan.py            # the table
    python benchmarks/bench_plan.py --growth   # ops vs seconds, DeepSeek-V3 up to ~1M ops

Each plan is built cold (cache cleared) three times, validated (exact cover)
inside the timing; best and median are reported.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import megarefit
from megarefit.demo.bench import machine, time_cold_plan

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


GROWTH = [  # DeepSeek-V3, etp = tp: ops grow with tp * experts
    dict(tp=1, pp=1, ep=8), dict(tp=2, pp=1, ep=16), dict(tp=4, pp=1, ep=32), dict(tp=8, pp=1, ep=64),
    dict(tp=8, pp=1, ep=64, fp8=True), dict(tp=16, pp=1, ep=128), dict(tp=16, pp=1, ep=128, fp8=True),
]


def growth() -> None:
    """Planned + validated seconds (one cold run each, the plan caches cleared) against ops:
    the columnar planner's curve, FP8 planning on top where marked."""
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.quant import Fp8Format, planning

    cfg = json.loads((ROOT / "tests/data/configs/DeepSeek-V3.json").read_text())
    dims = megarefit.ModelDims.from_hf_config(cfg)
    print(f"machine: {machine()}")
    print("| DeepSeek-V3 layout | source tensors | ops | planned + validated s | us per op |")
    print("|---|---:|---:|---:|---:|")
    for kw in GROWTH:
        kw = dict(kw)
        fp8 = kw.pop("fp8", False)
        layout = megarefit.SourceLayout.build(padded_vocab_size=dims.padded_vocab_size(kw["tp"]),
                                              num_layers=dims.num_layers, **kw)
        plan_megatron_to_hf.cache_clear()
        planning._CACHE.clear()
        t0 = time.perf_counter()
        plan = plan_megatron_to_hf(dims, layout)
        if fp8:
            plan = planning.plan_fp8(plan, Fp8Format())
        seconds = time.perf_counter() - t0
        desc = " ".join(f"{k}={v}" for k, v in kw.items()) + (" FP8" if fp8 else "")
        print(f"| {desc} | {len(plan.sources)} | {len(plan.ops)} | {seconds:.2f} | "
              f"{seconds / len(plan.ops) * 1e6:.2f} |", flush=True)


def main() -> None:
    if "--growth" in sys.argv:
        growth()
        return
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
