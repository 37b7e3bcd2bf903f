"""What a merged LoRA refit costs the trainer: ``MergedLoRA.refresh()`` vs a plain served copy.

Two trainer ranks (tp 2, gloo, CPU, one process each) hold Bridge ``LoRA`` shards of a dense GPT (every
decoder linear wrapped: ``to_wrap.weight`` and A / B with the local shapes of
:mod:`megarefit.layout.lora`, bf16). Per rank and repeat, timed in the same run:

* **merged**: ``MergedLoRA.refresh()``: one ``all_gather`` of the split factors (A of qkv / fc1, B of
  proj / fc2), then per linear ``(W.float() + (alpha / r) * (B.float() @ A.float())).to(bf16)`` into
  its served copy;
* **plain**: what a full-weight trainer serving snapshot copies does for the same bases
  (:func:`~megarefit.online.trainer.served.refresh_snapshot`: one ``copy_`` per tensor).

Bytes: the served copies (equal for both) and what a refresh receives over TP. Medians with min-max
over repeats and both ranks; one torch thread a rank.

    python benchmarks/bench_lora_merge.py [--layers 4] [--hidden 512] [--ranks 16 64] [--repeat 9]
                                          [--record docs/lora_merge_cpu.jsonl]
    python benchmarks/bench_lora_merge.py --from-json docs/lora_merge_cpu.jsonl    # the recorded table
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


def _shards(cfg: dict, r: int, tp: int, tp_rank: int):
    import torch

    from megarefit.layout.dims import ModelDims
    from megarefit.layout.lora import adapter_local_shape
    from megarefit.specs.lora import LORA_ROWS
    from megarefit.specs.table import ParallelMode

    dims = ModelDims.from_hf_config(cfg)
    g = torch.Generator().manual_seed(tp_rank)
    out = {}
    for layer in range(dims.num_layers):
        for row in LORA_ROWS:
            base = row.base
            shape = [dims.size(s) for s in base.shape]
            shape[0 if base.role.parallel_mode is ParallelMode.COLUMN else 1] //= tp
            wrapped = base.megatron.format(layer=layer).replace(".weight", ".to_wrap.weight")
            out.setdefault(wrapped, torch.randn(shape, generator=g).to(torch.bfloat16))
            out[row.megatron.format(layer=layer)] = (0.1 * torch.randn(adapter_local_shape(row, dims, r, tp),
                                                                       generator=g)).to(torch.bfloat16)
    return dims, out


def job(rank: int, world_size: int, master_port: int, cfg: dict, ranks: list[int], repeat: int) -> dict:
    import torch
    import torch.distributed as dist

    from megarefit.online.trainer.lora_merge import MergedLoRA
    from megarefit.online.trainer.served import refresh_snapshot, snapshot_buffers

    torch.set_num_threads(1)  # one core a rank (2 ranks on this 2-core box): no oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world_size)
    out = {}
    for r in ranks:
        dims, params = _shards(cfg, r, world_size, rank)
        merged = MergedLoRA(params, dims, alpha=2 * r, rank=r, tp=world_size, tp_rank=rank, tp_group=dist.group.WORLD)
        bases = {n: p for n, p in params.items() if ".to_wrap." in n}
        snapshot = snapshot_buffers(bases, list(bases))
        times: dict[str, list[float]] = {"merged": [], "plain": []}
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            merged.refresh()
            times["merged"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            refresh_snapshot(snapshot, bases)
            times["plain"].append(time.perf_counter() - t0)
        out[r] = {"times": times, "gathered_bytes": merged.gathered_bytes, "copy_bytes": merged.served_copy_bytes,
                  "adapter_bytes": sum(p.nbytes for n, p in params.items() if ".adapter." in n)}
    dist.destroy_process_group()
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def measure(ns) -> dict:
    from conftest import tiny_config  # the suite's worker start method too

    from megarefit.demo.bench import machine
    from megarefit.demo.workers import run_workers

    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=ns.layers, hidden_size=ns.hidden, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=ns.hidden // 8, intermediate_size=3 * ns.hidden)
    per_rank = run_workers(job, world_size=2, args=(cfg, ns.ranks, ns.repeat), timeout=600)
    rows = []
    for r in ns.ranks:
        one = [p[r] for p in per_rank]
        rows.append({"r": r, **{k: _stats([t for p in one for t in p["times"][k]]) for k in ("merged", "plain")},
                     "gathered_bytes": one[0]["gathered_bytes"], "copy_bytes": one[0]["copy_bytes"],
                     "adapter_bytes": one[0]["adapter_bytes"]})
    return {"rows": rows, "tp": 2, "layers": ns.layers, "hidden": ns.hidden, "ffn": 3 * ns.hidden, "dtype": "bfloat16",
            "repeat": ns.repeat, "machine": machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def print_table(res: dict) -> None:
    print(f"Trainer side of a merged LoRA refit, per rank: tp {res['tp']} (gloo, one process a rank), "
          f"{res['layers']} layers, hidden {res['hidden']}, ffn {res['ffn']}, every decoder linear wrapped by "
          f"Bridge LoRA, {res['dtype']}, one torch thread a rank; median (min-max) over {res['repeat']} repeats x 2 ranks; {res['machine']}, "
          f"{res['date']} (a 2-core machine shared with other jobs: the ranges are wide).\n")
    print("| r | merged `refresh()` ms | plain served copy ms | x plain | served copy MB | adapter MB | "
          "gathered per refresh kB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in res["rows"]:
        m, p = row["merged"], row["plain"]
        print(f"| {row['r']} | {m['median'] * 1e3:.1f} ({m['min'] * 1e3:.1f}-{m['max'] * 1e3:.1f}) | "
              f"{p['median'] * 1e3:.2f} ({p['min'] * 1e3:.2f}-{p['max'] * 1e3:.2f}) | {m['median'] / p['median']:.0f} | "
              f"{row['copy_bytes'] / 1e6:.1f} | {row['adapter_bytes'] / 1e6:.2f} | {row['gathered_bytes'] / 1e3:.0f} |")


def model_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The LoRA benchmarks' model and repeat options (this one's and bench_lora_cycle.py's)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64], help="adapter ranks r")
    ap.add_argument("--repeat", type=int, default=9)
    return ap


def main() -> None:
    recorded_main(model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])), measure, print_table)


if __name__ == "__main__":
    main()
