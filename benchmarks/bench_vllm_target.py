"""Per-worker bytes and time when vLLM tensor-parallel workers pull only their own shards.

    python benchmarks/bench_vllm_target.py [--config tests/data/configs/Qwen3-8B.json] [--tp 2] [--device cuda]

Trainer shards (random, planned shapes, trainer ``--tp``) live on ``--device``. For
vLLM tp T in 1, 2, 4, 8, worker rank 0 runs a warm ``run_refit_cycle`` of
``plan_megatron_to_vllm`` into preallocated shard buffers; reported against a plain
``copy_`` of the same byte count (one contiguous block) and against the full-HF-tensor
refit every worker otherwise does. All numbers from one run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import megarefit
from megarefit.demo.bench import best_of
from megarefit.planner import plan_megatron_to_hf
from megarefit.transport.execute import run_refit_cycle
from megarefit.transport.local import LocalTransport
from megarefit.targets import VllmTarget, plan_megatron_to_vllm

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-8B.json"))
    ap.add_argument("--tp", type=int, default=2, help="trainer tensor-parallel size")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    dims = megarefit.ModelDims.from_hf_config(cfg)
    layout = megarefit.SourceLayout.build(tp=args.tp, pp=1, padded_vocab_size=dims.padded_vocab_size(args.tp),
                                          num_layers=dims.num_layers)
    full = plan_megatron_to_hf(dims, layout, "bfloat16")
    shards: dict = {}
    for ref, meta in full.sources.items():
        shards.setdefault(ref.rank, {})[ref.name] = torch.randn(meta.shape, device=args.device).to(torch.bfloat16)
    transport = LocalTransport(shards)

    def warm(plan):
        buffers = {r.name: torch.empty(m.shape, dtype=torch.bfloat16, device=args.device) for r, m in plan.targets.items()}

        def run():
            for _ in run_refit_cycle(plan, transport, buffers=buffers):
                pass
        run()
        return best_of(run, args.repeat, args.device)[0]

    full_s = warm(full)
    print(f"model {Path(args.config).stem}, trainer tp={args.tp}, bf16, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device != "cpu" else ""))
    print("| vLLM tp | bytes per worker | refit warm | GB/s | vs plain copy of those bytes | vs full-tensor refit |")
    print("|---:|---:|---:|---:|---:|---:|")
    for T in (1, 2, 4, 8):
        try:
            plan = plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(T, 0))
        except megarefit.errors.MegarefitError as exc:
            print(f"| {T} | -- | {exc} | | | |")
            continue
        s = warm(plan)
        block = torch.empty(plan.nbytes, dtype=torch.uint8, device=args.device)
        other = torch.empty_like(block)
        copy_s = best_of(lambda: other.copy_(block), args.repeat, args.device)[0]
        print(f"| {T} | {plan.nbytes / 1e9:.2f} GB | {s * 1e3:.1f} ms | {plan.nbytes / s / 1e9:.0f} | "
              f"{copy_s / s:.2f}x | {full_s / s:.2f}x faster |")
    print(f"full-tensor refit (what every worker pulls without sharding): {full.nbytes / 1e9:.2f} GB "
          f"in {full_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
