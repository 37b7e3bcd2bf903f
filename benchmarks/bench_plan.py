"""Plan time and op counts for full-size models at realistic trainer layouts (shapes only).

    python benchmarks/bench_plan.py            # the table
    python benchmarks/bench_plan.py --growth   # ops vs seconds, DeepSeek-V3 up to ~1M ops
    python benchmarks/bench_plan.py --cli --json docs/plan_cli.jsonl   # `megarefit plan` as a whole process
    python benchmarks/bench_plan.py --from-json docs/plan_cli.jsonl    # the recorded table

Each plan is built cold (cache cleared) three times, validated (exact cover)
inside the timing; best and median are reported.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
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


CLI_CASES = [  # (config, arguments after `megarefit plan --config CONFIG`): the default (block FP8 from the config)
    ("DeepSeek-V3", ["--tp", "8", "--ep", "64"]),
    ("DeepSeek-V3", ["--tp", "8", "--ep", "64", "--quantization", "none"]),
    ("Kimi-K2-Instruct", ["--tp", "8", "--ep", "64"]),
    ("Kimi-K2-Instruct", ["--tp", "8", "--ep", "64", "--quantization", "none"]),
    ("GLM-5", ["--tp", "8", "--pp", "4", "--ep", "64", "--first-stage-layers", "20", "--last-stage-layers", "20",
               "--quantization", "fp8"]),
    ("GLM-5", ["--tp", "8", "--pp", "4", "--ep", "64", "--first-stage-layers", "20", "--last-stage-layers", "20"]),
    ("gpt-oss-120b", ["--tp", "4", "--ep", "8", "--quantization", "none"]),  # bf16 (the config says MXFP4)
    ("gpt-oss-120b", ["--tp", "4", "--ep", "8", "--quantization", "none", "--vllm-tp", "8", "--vllm-ep"]),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B", ["--tp", "4", "--ep", "8"]),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B", ["--tp", "4", "--ep", "8", "--vllm-tp", "4", "--vllm-ep"]),
]


def cli(repeat: int, record: str | None) -> None:
    """``megarefit plan`` as users run it: a fresh process per run (imports included), its
    wall time and the planned + validated seconds it prints; the median of ``repeat`` runs."""
    rows = []
    for name, args in CLI_CASES:
        argv = [sys.executable, "-m", "megarefit", "plan", "--config", str(ROOT / f"tests/data/configs/{name}.json"),
                *args]
        walls, planned, summary = [], [], ""
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            walls.append(time.perf_counter() - t0)
            planned.append(float(re.search(r"planned \+ validated in ([0-9.]+) s", out).group(1)))
            summary = next(line for line in out.splitlines() if "validated exact cover" in line)
        rows.append({"config": name, "args": " ".join(args), "ops": int(re.search(r"; ([0-9]+) ops", summary).group(1)),
                     "planned_s": statistics.median(planned), "whole_s": statistics.median(walls),
                     "whole_max_s": max(walls), "repeat": repeat, "machine": machine(),
                     "date": time.strftime("%Y-%m-%d")})
        print(json.dumps(rows[-1]), flush=True)
    if record:
        Path(record).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_cli(rows)


def print_cli(rows: list[dict]) -> None:
    """The recorded ``--cli`` rows as a markdown table, machine and date first."""
    print(f"`megarefit plan`, median of {rows[0]['repeat']} fresh processes on {rows[0]['machine']}, "
          f"{rows[0]['date']}:\n")
    print("| `megarefit plan --config` | ops | planned + validated | whole process (median / max) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']}.json {r['args']} | {r['ops']} | {r['planned_s']:.2f} s | "
              f"**{r['whole_s']:.2f} s** / {r['whole_max_s']:.2f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--growth", action="store_true", help="ops vs seconds, DeepSeek-V3 up to ~1M ops")
    ap.add_argument("--cli", action="store_true", help="time `megarefit plan` as a whole process")
    ap.add_argument("--repeat", type=int, default=5, help="--cli runs per case (default 5)")
    ap.add_argument("--json", help="--cli: record the rows in this JSONL file")
    ap.add_argument("--from-json", help="print the table of a recorded --cli JSONL file and exit")
    ns = ap.parse_args()
    if ns.from_json:
        print_cli([json.loads(line) for line in Path(ns.from_json).read_text().splitlines() if line.strip()])
        return
    if ns.cli:
        cli(ns.repeat, ns.json)
        return
    if ns.growth:
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
