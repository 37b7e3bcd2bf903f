"""Staged vs streamed refits: time and peak extra receiver memory, in one process.

    python benchmarks/bench_streamed.py --config tests/data/configs/Qwen3-8B.json --layers 8 --tp 2 \\
        --vllm-tp 2 --device cuda:0 [--budget auto|BYTES ...] [--json out.jsonl]

Trainer ranks are :class:`~megarefit.online.trainer.publisher.Publisher` s in this process serving
random shards (the planned local shapes) from ``--trainer-device``; a staged
:class:`~megarefit.online.RefitReceiver` and one streamed receiver per ``--budget`` pull them
into ``--device``, and a consumer copies every tensor into its own preallocated "model"
(what vLLM's ``load_weights`` does). Per receiver, warm cycles: best seconds, bytes handed
over, ``stats.peak_extra_bytes`` (ring or arena, plus scratch, as the receiver counts them)
and, on a GPU, the measured peak: ``torch.cuda.max_memory_allocated`` during the cycles
minus what was allocated before the receiver existed (the model and the trainers' shards).
Each streamed receiver's tensors are compared with the staged one's, bit for bit.

NIXL agents in one process move bytes through the host (0.8 GB/s measured on an H200): the
ratio of streamed to staged time is what this measures, not the link's rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _trainers(cfg: dict, ns: argparse.Namespace):
    from megarefit.demo.bench import layout_for
    from megarefit.layout.geometry import source_tensors
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret
    from megarefit.online.trainer.publisher import Publisher

    dims, layout = layout_for(cfg, tp=ns.tp, ep=ns.ep, layers=ns.layers)
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job="bench-streamed")
    g = torch.Generator(device=ns.trainer_device).manual_seed(0)
    pubs = []
    for rank, tensors in source_tensors(dims, layout).items():
        shards = {n: torch.randn(t.shape, generator=g, device=ns.trainer_device).to(torch.bfloat16)
                  for n, t in tensors.items()}
        pubs.append(Publisher(shards, cfg, rank=rank, layout=source_layout(cfg, tp=ns.tp, pp=1, ep=ns.ep),
                              rendezvous=rdzv, agent_name=f"bench-streamed-t{rank.tp}-e{rank.ep}", quantization=None))
    for p in pubs:
        p.publish(1)
    return rdzv, pubs


_RUNS = iter(range(1000))


def _run(rdzv, ns: argparse.Namespace, budget, model: dict | None) -> tuple[dict, dict]:
    """One receiver's cycles; ``model``: the consumer's tensors, allocated before (``None``: built
    during the first cycle, then counted in the measured peak)."""
    from megarefit.online import RefitReceiver
    from megarefit.targets import VllmTarget

    cuda = ns.device.startswith("cuda")
    target = VllmTarget(ns.vllm_tp, 0) if ns.vllm_tp else None
    if cuda:
        torch.cuda.synchronize(ns.device)
        base = torch.cuda.memory_allocated(ns.device)
        torch.cuda.reset_peak_memory_stats(ns.device)
    rx = RefitReceiver(rdzv, name=f"bench-rx-{next(_RUNS)}", timeout=300, target=target, device=ns.device,
                       memory_budget=budget)
    times, model = [], model if model is not None else {}

    def install(weights) -> None:
        for name, t in weights:
            if name not in model:
                model[name] = torch.empty_like(t)  # the first cycle builds the consumer's model
            model[name].copy_(t)

    for _ in range(ns.cycles):
        t0 = time.perf_counter()
        rx.refit(install, 1)
        if cuda:
            torch.cuda.synchronize(ns.device)
        times.append(time.perf_counter() - t0)
    share = sum(t.numel() * t.element_size() for t in model.values())
    row = {"install": rx.stats.install, "budget": budget, "groups": rx.stats.groups, "best_s": min(times[1:] or times),
           "cold_s": times[0], "share_bytes": share, "peak_extra_bytes": rx.stats.peak_extra_bytes,
           "measured_peak_extra_bytes": (torch.cuda.max_memory_allocated(ns.device) - base) if cuda else None}
    rx.close()
    return row, model


def table(rows: list[dict]) -> str:
    """The markdown table of result rows (as printed, and as docs/benchmarks.md shows them)."""
    lines = [("| install | budget | groups | warm s | vs staged | share MB | extra MB (counted) | extra MB (measured) "
             "| equal |"), "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        measured = "-" if r["measured_peak_extra_bytes"] is None else f"{r['measured_peak_extra_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['install']} | {r['budget']} | {r['groups']} | {r['best_s']:.4f} "
                     f"| {r.get('vs_staged', 1.0):.2f} | {r['share_bytes'] / 1e6:.1f} "
                     f"| {r['peak_extra_bytes'] / 1e6:.1f} | {measured} | {r.get('equal_to_staged', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megarefit.demo.bench import bench_config, machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--vllm-tp", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trainer-device", default=None)
    ap.add_argument("--budget", nargs="+", default=["auto"])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", default=None, help="print the table of recorded results (a --json file)")
    ns = ap.parse_args(argv)
    if ns.from_json:
        rows = [json.loads(line) for line in Path(ns.from_json).read_text().splitlines() if line.strip()]
        runs: dict[tuple, list[dict]] = {}
        for r in rows:
            runs.setdefault(tuple(r.get(k) for k in ("machine", "config", "layers", "tp", "ep", "vllm_tp", "device")),
                            []).append(r)
        for (mach, config, layers, tp, ep, vllm_tp, device), group in runs.items():
            print(f"machine: {mach}; config {config} layers={layers} tp={tp} ep={ep or 1} vllm_tp={vllm_tp} "
                  f"device={device}\n")
            print(table(group) + "\n")
        return 0
    ns.trainer_device = ns.trainer_device or ns.device
    rdzv, _pubs = _trainers(bench_config(ns.config, ns.layers), ns)
    _, want = _run(rdzv, ns, None, None)  # the consumer's model: its names and shapes
    staged, _ = _run(rdzv, ns, None, {k: torch.empty_like(v) for k, v in want.items()})
    rows = [staged]
    for b in ns.budget:
        budget = b if b == "auto" else int(float(b))
        row, got = _run(rdzv, ns, budget, {k: torch.empty_like(v) for k, v in want.items()})
        row["equal_to_staged"] = got.keys() == want.keys() and all(
            torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
        row["vs_staged"] = row["best_s"] / staged["best_s"]
        rows.append(row)
    print(f"machine: {machine()}; config {Path(ns.config).name} layers={ns.layers or 'all'} tp={ns.tp} ep={ns.ep} "
          f"vllm_tp={ns.vllm_tp or '-'} device={ns.device}")
    print(table(rows))
    if ns.json:
        with open(ns.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"machine": machine(), "config": Path(ns.config).name, "layers": ns.layers,
                                    "tp": ns.tp, "ep": ns.ep, "vllm_tp": ns.vllm_tp, "device": ns.device,
                                    **r}) + "\n")
    return 0 if all(r.get("equal_to_staged", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
