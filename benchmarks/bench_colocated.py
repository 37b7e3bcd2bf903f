"""Colocated refit (issue 22): trainer processes and the receiver process on ONE GPU, read
through CUDA IPC, against a plain device copy of the same bytes and NIXL on the same GPU.

Run from the repo root on a GPU machine (trainers and receiver both on cuda:0):

    python benchmarks/bench_colocated.py --config tests/data/configs/Qwen3-8B.json --tp 2 \\
        [--vllm-tp 2] [--layers 8] [--nixl-cycles 2] [--json docs/colocated.jsonl]

One trainer process per Megatron rank serves random bf16 shards from one contiguous buffer
(as Megatron's DDP parameter buffer) through a real :class:`~megarefit.online.trainer.publisher.Publisher`,
which exports its CUDA storages for IPC. This process measures, in one run:

* ``plain copy``: ``dst.copy_(src)`` of the same bytes on the GPU (the speed of light here);
* ``CUDA IPC staged``: ``RefitReceiver(transport="ipc")`` cycles (the pull into the arena,
  fenced; nothing installed), cold (opening the handles, planning, compiling the copies)
  and warm; ``open`` is the seconds spent opening the trainers' handles;
* ``CUDA IPC staged + install`` and ``CUDA IPC streamed`` (``memory_budget="auto"``): the
  cycle with the consumer copying every tensor into its own model, as an inference engine does;
* ``CUDA IPC streamed, direct``: the same with the model's tensors given as ``direct`` targets
  (copied straight from the trainers' memory into them: one copy, no ring bytes);
* ``NIXL, same GPU`` (``--nixl-cycles``): the same staged cycle over NIXL/UCX between the two
  processes (through the host: slow, so few cycles);

with the receiver's peak extra GPU memory next to each, and every path's bytes compared with
the staged CUDA IPC pull's, bit for bit. ``--from-json FILE`` prints the recorded tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

_RUNS = iter(range(1000))


def _receiver(rdzv, ns: argparse.Namespace, **kw):
    from megarefit.online import RefitReceiver
    from megarefit.targets import VllmTarget

    target = VllmTarget(ns.vllm_tp, 0, expert_parallel=ns.vllm_ep) if ns.vllm_tp else None
    return RefitReceiver(rdzv, name=f"bench-colo-{next(_RUNS)}", timeout=600, target=target, device=ns.device, **kw)


def _measure(rdzv, ns: argparse.Namespace, label: str, cycles: int, *, install: bool, keep: dict | None = None,
             **kw) -> dict:
    """``cycles`` refits of version 1 by one new receiver; its row. ``install``: copy every
    tensor into a model of its own (kept in ``keep`` when given, to compare bytes)."""
    torch.cuda.synchronize(ns.device)
    torch.cuda.reset_peak_memory_stats(ns.device)
    base = torch.cuda.memory_allocated(ns.device)
    rx = _receiver(rdzv, ns, **kw)
    model: dict = {} if keep is None else keep
    times = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        if install:
            def copy_in(weights) -> None:
                for name, t in weights:
                    if name not in model:
                        model[name] = torch.empty_like(t)
                    model[name].copy_(t)
            rx.refit(copy_in, 1)
        else:
            for name, t in rx.run_refit_cycle(1):
                if keep is not None:
                    keep[name] = t
        torch.cuda.synchronize(ns.device)
        times.append(time.perf_counter() - t0)
    s = rx.stats
    model_bytes = sum(t.numel() * t.element_size() for t in model.values()) if install else 0
    row = {"path": label, "cycles": cycles, "cold_s": times[0], "best_s": min(times[1:] or times),
           "median_s": statistics.median(times[1:] or times), "samples": times[1:], "bytes": s.bytes_moved, "ipc_bytes": s.ipc_bytes,
           "ipc_ranks": s.ipc_ranks, "install": s.install, "groups": s.groups, "warm_seconds": s.seconds,
           "peak_extra_bytes": torch.cuda.max_memory_allocated(ns.device) - base - model_bytes,
           "counted_extra_bytes": s.peak_extra_bytes,
           "open_s": rx.transport.ipc.open_seconds, "storages_opened": rx.transport.ipc.opened_storages,
           "copies": sum(p.local.copies for p in rx.transport.prepared if p.local is not None)}
    rx.close()
    if keep is None:
        model.clear()
    return row


def _plain_copy(nbytes: int, ns: argparse.Namespace, time_each) -> list[float]:
    """Seconds of each of ``ns.cycles`` warm ``dst.copy_(src)`` of ``nbytes`` on the device,
    one contiguous copy each (freed after)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=ns.device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # cold
    return time_each(lambda: dst.copy_(src), ns.cycles, ns.device)  # freed on return; the caller empties the cache


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def table(rows: list[dict]) -> str:
    """The markdown table of one case (as printed, and as docs/benchmarks.md shows it): the warm
    cycles' median (and best); ratio: the plain copy's best (its other cycles were not
    recorded) over the path's median."""
    lines = ["| path | warm ms median (min-max, or best) | GB/s (median) | vs plain copy | cold s | open s "
             "| extra GPU MB (measured) | equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        med = r.get("median_s") or r["best_s"]
        ms = (f"{med * 1e3:.1f} ({min(r['samples']) * 1e3:.1f}-{max(r['samples']) * 1e3:.1f})" if r.get("samples")
              else f"{med * 1e3:.1f} ({r['best_s'] * 1e3:.1f})")
        lines.append(f"| {r['path']} | {ms} | {r['bytes'] / med / 1e9:.0f} "
                     f"| {_copy(r) / med:.2f}x | {r.get('cold_s', 0):.3f} "
                     f"| {r.get('open_s', 0):.3f} | {r.get('peak_extra_bytes', 0) / 1e6:.0f} | {r.get('equal', '-')} |")
    return "\n".join(lines)


def _copy(r: dict) -> float:
    """The baseline's seconds: the plain copy's median where every copy was recorded, else its best."""
    return r.get("copy_median_s") or r["copy_best_s"]


def summary(path: str) -> str:
    """One sentence: the CUDA IPC pull alone and pull + install against one plain device copy of
    the same bytes (its best; ratio over the path's median), over every recorded case."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]

    def span(path_name: str) -> str:
        v = [_copy(r) / r["median_s"] for r in rows if r["path"] == path_name]
        return f"{min(v):.2f}-{max(v):.2f}x"

    gpu = rows[0]["machine"].rsplit("GPU ", 1)[-1]
    return (f"On one {gpu} a warm CUDA IPC pull runs at {span('CUDA IPC, staged (pull only)')} of one plain device "
            f"copy of the same bytes, pull + install into the model at {span('CUDA IPC, staged + install')} "
            f"(streamed straight into the model: {span('CUDA IPC, streamed (auto budget), direct into the model')}; "
            + ("median warm cycle against the copy's median, " + rows[0]["date"] if "copy_median_s" in rows[0]
               else "median warm cycle against the copy's best") + ").")


def describe(r: dict) -> str:
    return (f"machine: {r['machine']}\nmodel: {r['config']}, {r['layers']} layers, bf16, trainer tp={r['tp']} "
            f"ep={r['ep']} etp={r['etp']} {r['expert_layout']}, {r['ranks']} trainer processes and the receiver "
            f"on {r['device']}; target: {r['target']}; {r['bytes'] / 1e9:.3f} GB per cycle; plain copy of the same "
            f"bytes {r['copy_best_s']:.4f} s")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    ap.add_argument("--tp", type=int, default=2, help="trainer tensor parallel size (one process per rank)")
    ap.add_argument("--ep", type=int, default=1, help="trainer expert parallel size")
    ap.add_argument("--etp", type=int, default=0, help="expert tensor parallel size (0: tp)")
    ap.add_argument("--expert-layout", default="sequential", choices=["sequential", "te_grouped", "legacy_grouped"])
    ap.add_argument("--vllm-tp", type=int, default=0, help="receive vLLM worker 0's own shards (0: full HF tensors)")
    ap.add_argument("--vllm-ep", action="store_true", help="vLLM enable_expert_parallel")
    ap.add_argument("--device", default="cuda:0", help="the GPU of the trainers and the receiver")
    ap.add_argument("--cycles", type=int, default=6, help="cycles per CUDA IPC path (the first is cold)")
    ap.add_argument("--nixl-cycles", type=int, default=0, help="cycles over NIXL on the same GPU (0: skip; slow)")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", help="append one JSON line per path")
    ap.add_argument("--from-json", help="print the tables of recorded results (a --json file) and exit")
    ap.add_argument("--summary", action="store_true", help="with --from-json: one sentence, not the tables")
    return ap


def _print_recorded(path: str) -> int:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["machine"], r["config"], r["layers"], r["target"], r["tp"], r["ep"], r["label"]), []).append(r)
    print("\n\n".join(describe(group[0]) + "\n\n" + table(group) for group in cases.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench_nixl import _setup, trainer

    from megarefit.demo.bench import bench_config, machine, time_each
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ns = _parser().parse_args(argv)
    if ns.from_json and ns.summary:
        print(summary(ns.from_json))
        return 0
    if ns.from_json:
        return _print_recorded(ns.from_json)
    cfg = bench_config(ns.config, ns.layers)
    args = {"tp": ns.tp, "ep": ns.ep, "etp": ns.etp, "expert_layout": ns.expert_layout, "vllm_tp": ns.vllm_tp,
            "vllm_ep": ns.vllm_ep, "vllm_rank": 0, "quantization": "none", "trainer_device": ns.device,
            "dtype": "bfloat16", "param_buffer": True}
    dims, layout, plan = _setup(cfg, args)
    ranks = len(layout.ranks())
    args["raw_bytes"] = [0] * ranks  # no raw NIXL block: this benchmark's baseline is a device copy
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job="bench")
    group = start_workers(trainer, world_size=ranks, args=(rdzv.port, cfg, args))
    rdzv.store.wait([f"bench/quantize/{r}" for r in range(ranks)], timedelta(seconds=900))
    copy_times = _plain_copy(plan.nbytes, ns, time_each)
    copy_best = min(copy_times)
    torch.cuda.empty_cache()
    staged: dict = {}
    rows = [_measure(rdzv, ns, "CUDA IPC, staged (pull only)", ns.cycles, install=False, keep=staged,
                     transport="ipc")]
    rows[0]["equal"] = "reference"
    installed: dict = {}
    rows.append(_measure(rdzv, ns, "CUDA IPC, staged + install", ns.cycles, install=True, keep=installed,
                         transport="ipc"))
    rows[-1]["equal"] = _same(installed, staged)
    installed.clear()
    rows.append(_measure(rdzv, ns, "CUDA IPC, streamed (auto budget) + install", ns.cycles, install=True,
                         keep=installed, transport="ipc", memory_budget="auto"))
    rows[-1]["equal"] = _same(installed, staged)
    installed.clear()
    model = {k: torch.empty_like(v) for k, v in staged.items()}
    rows.append(_measure(rdzv, ns, "CUDA IPC, streamed (auto budget), direct into the model", ns.cycles,
                         install=True, keep={}, transport="ipc", memory_budget="auto", direct=model))
    rows[-1]["equal"] = _same(model, staged)
    del model
    if ns.nixl_cycles:
        over: dict = {}
        rows.append(_measure(rdzv, ns, "NIXL, same GPU, staged (pull only)", ns.nixl_cycles, install=False,
                             keep=over, transport="nixl"))
        rows[-1]["equal"] = _same(over, staged)
    rdzv.mark_consumed(1)
    group.join(timeout=300)
    target = (f"vLLM worker 0 of tp={ns.vllm_tp}" + (" EP" if ns.vllm_ep else "")) if ns.vllm_tp else "full HF tensors"
    head = {"machine": machine(), "label": ns.label, "config": Path(ns.config).stem, "layers": dims.num_layers,
            "tp": layout.tp, "ep": layout.ep, "etp": layout.etp, "expert_layout": layout.expert_layout,
            "ranks": ranks, "target": target, "device": ns.device, "copy_best_s": copy_best,
            "copy_median_s": statistics.median(copy_times), "date": time.strftime("%Y-%m-%d")}
    rows = [{**head, **r} for r in rows]
    rows.append({**head, "path": "plain device copy, same bytes", "best_s": copy_best,
                 "median_s": statistics.median(copy_times), "samples": copy_times, "bytes": rows[0]["bytes"]})
    print(describe(rows[0]) + "\n\n" + table(rows), flush=True)
    print("warm stage seconds (staged):", {k: round(v, 5) for k, v in rows[0]["warm_seconds"].items()})
    print(f"copies per cycle: {rows[0]['copies']}; storages opened: {rows[0]['storages_opened']}")
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0 if all(r.get("equal", True) in (True, "reference") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
