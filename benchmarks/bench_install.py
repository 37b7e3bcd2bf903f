"""The install after a prefetch: device copies of a vLLM worker's shards into its live parameters.

    python benchmarks/bench_install.py --json docs/install_gpu_h200.jsonl      # on a GPU machine
    python benchmarks/bench_install.py --from-json docs/install_gpu_h200.jsonl # the table

With a prefetch (:meth:`RefitReceiver.prefetch`), the receiver's arena holds the worker's
shards of the next version, fenced, before vLLM pauses; the pause is then the install alone:
one copy of every planned shard (vLLM parameter names and shapes of ``VllmTarget(tp, rank 0)``,
``plan_megatron_to_vllm`` of the real config) from its arena view into the parameter's own
memory. That copy is the floor of the stall (vLLM's pause / resume and its per-layer reload
bookkeeping come on top; real GPU vLLM cannot be installed on the lent machines).

Timed, each the median (range) of ``--repeat`` runs after a warm-up, from one run on one device:

    loop       param.copy_(arena_view) per tensor, as vLLM's weight loaders do
    foreach    one torch._foreach_copy_ over every tensor
    baseline   one contiguous copy_ of the same bytes (the strict baseline)

Peak memory: the arena plus the parameters (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def shard_shapes(config: Path, tp: int, expert_parallel: bool, trainer_tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(vLLM parameter name, local shape) of vLLM worker 0's shards, in the plan's order."""
    import megarefit
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg = json.loads(config.read_text())
    dims = megarefit.ModelDims.from_hf_config(cfg)
    ep = trainer_tp if dims.num_experts else 1
    layout = megarefit.SourceLayout.build(tp=trainer_tp, pp=1, ep=ep,
                                          padded_vocab_size=dims.padded_vocab_size(trainer_tp),
                                          num_layers=dims.num_layers)
    plan = plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(tp=tp, rank=0, expert_parallel=expert_parallel))
    return [(ref.name, tuple(meta.storage_shape or meta.shape)) for ref, meta in plan.targets.items()]


def _timed(fn, repeat: int, device: torch.device) -> list[float]:
    """Seconds of each of ``repeat`` calls after one warm-up call (synchronized around each)."""
    from megarefit.demo.bench import time_each

    return time_each(fn, repeat + 1, device)[1:]


def measure(config: Path, tp: int, expert_parallel: bool, trainer_tp: int, repeat: int, device: torch.device) -> dict:
    shapes = shard_shapes(config, tp, expert_parallel, trainer_tp)
    sizes = [int(torch.Size(s).numel()) for _, s in shapes]
    total = sum(sizes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    arena = torch.empty(total, dtype=torch.bfloat16, device=device)
    params = torch.empty(total, dtype=torch.bfloat16, device=device)
    arena.normal_()
    srcs = [v.view(s) for v, (_, s) in zip(arena.split(sizes), shapes)]
    dsts = [v.view(s) for v, (_, s) in zip(params.split(sizes), shapes)]

    def loop() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    out = {"loop": _timed(loop, repeat, device), "foreach": _timed(lambda: torch._foreach_copy_(dsts, srcs), repeat, device),
           "baseline": _timed(lambda: params.copy_(arena), repeat, device)}
    assert torch.equal(params, arena)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 2 * total * 2
    return {"config": config.stem, "vllm_tp": tp, "expert_parallel": expert_parallel, "trainer_tp": trainer_tp,
            "tensors": len(shapes), "bytes": total * 2, "peak_bytes": peak, **{f"{k}_s": v for k, v in out.items()}}


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"


def table(rows: list[dict]) -> str:
    head = rows[0]
    lines = [f"{head['machine']}; {head['date']}; torch {head['torch']}; bf16; vLLM worker 0's shards "
             f"(trainer tp {head['trainer_tp']})", "",
             "| model | vLLM tp | EP | tensors | shard GiB | loop copy_ (ms) | _foreach_copy_ (ms) | "
             "one contiguous copy (ms) | loop / contiguous | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = statistics.median(r["loop_s"]) / statistics.median(r["baseline_s"])
        lines.append(f"| {r['config']} | {r['vllm_tp']} | {'on' if r['expert_parallel'] else 'off'} | {r['tensors']} | "
                     f"{r['bytes'] / 2**30:.2f} | {_med(r['loop_s'])} | {_med(r['foreach_s'])} | "
                     f"{_med(r['baseline_s'])} | {ratio:.2f}x | {r['peak_bytes'] / 2**30:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["Qwen3-8B:2:off", "Qwen3-30B-A3B:2:off", "Qwen3-30B-A3B:2:on"],
                    help="CONFIG:VLLM_TP:EP (configs from tests/data/configs)")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--from-json")
    ns = ap.parse_args(argv)
    from megarefit.demo.bench import append_jsonl, machine, read_jsonl

    if ns.from_json:
        print(table(read_jsonl(ns.from_json)))
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for case in ns.cases:
        name, tp, ep = case.split(":")
        row = measure(ROOT / "tests/data/configs" / f"{name}.json", int(tp), ep == "on", ns.trainer_tp, ns.repeat, device)
        rows.append({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, **row})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_s")}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(rows))
    if ns.json:
        append_jsonl(ns.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
