"""Staged vs streamed refits over NIXL, trainers in their own processes: time, raw READ ratio, memory.

On two GPUs (issue 26: trainer processes on GPU 0; this receiver process on GPU 1, which it
never makes current, so every receiver here is built on a device that is not the process's
current one)::

    python benchmarks/bench_streamed_nixl.py --config tests/data/configs/Qwen3-8B.json --tp 2 --vllm-tp 2 \\
        --trainer-device cuda:0 --device cuda:1 --budget 1073741824 auto --json out.jsonl

CPU smoke run (UCX on loopback; seconds)::

    python benchmarks/bench_streamed_nixl.py --layers 2 --vllm-tp 2

One trainer process per Megatron rank (``bench_nixl.trainer``: a real Publisher over random
shards, plus one registered block of exactly the bytes this receiver reads from it). This
process allocates the consumer's "model" first (one tensor per target, as vLLM holds its
parameters), then, one receiver at a time, a staged :class:`~megarefit.online.RefitReceiver`
and a streamed one per ``--budget``, each running ``--cycles`` refits that copy every handed-over
tensor into the model (what vLLM's ``load_weights`` does). Per receiver: warm seconds (best; a
cycle's pull and install: the raw READ has no install), ``pull s`` (the receiver's own
seconds waiting for READs and placing, not installing; streamed, the READs of group k + 1
move while group k installs),
the ratio to a raw NIXL READ of the same bytes (one descriptor per trainer, in its own
process, warm), ``stats.peak_extra_bytes`` (counted) and, on a GPU, the measured peak extra
memory (``torch.cuda.max_memory_allocated`` on the receiver's device during its cycles minus
what was allocated before it existed), and the bytes this process allocated on its current
device (the trainers' GPU) meanwhile: 0 when nothing lands on the wrong device. Every streamed
model is compared with the staged one, bit for bit.
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


def _memory(device: str) -> int:
    return torch.cuda.memory_allocated(device) if device.startswith("cuda") else 0


def _run(rdzv, ns: argparse.Namespace, budget, model: dict, verify: bool = False) -> dict:
    """``--cycles`` refits of version 1 by one receiver into ``model`` (built by the first cycle
    when empty); its row of results."""
    from megarefit.online import RefitReceiver
    from megarefit.targets import VllmTarget

    cuda = ns.device.startswith("cuda")
    current = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    if cuda:
        torch.cuda.synchronize(ns.device)
        torch.cuda.reset_peak_memory_stats(ns.device)
    base, base_current = _memory(ns.device), _memory(current)
    target = VllmTarget(ns.vllm_tp, 0, expert_parallel=ns.vllm_ep) if ns.vllm_tp else None
    rx = RefitReceiver(rdzv, name=f"bench-rx-{next(_RUNS)}", timeout=300, target=target, device=ns.device,
                       memory_budget=budget, verify_checksums=verify)

    def install(weights) -> None:
        for name, t in weights:
            if name not in model:
                model[name] = torch.empty_like(t)
            model[name].copy_(t)

    times = []
    for _ in range(ns.cycles):
        t0 = time.perf_counter()
        rx.refit(install, 1)
        if cuda:
            torch.cuda.synchronize(ns.device)
        times.append(time.perf_counter() - t0)
    stats = rx.stats
    row = {"install": stats.install + (" + checksums" if verify else ""), "checked_bytes": stats.checked_bytes,
           "unchecked_bytes": stats.unchecked_bytes, "install_kind": stats.install, "budget": budget, "groups": stats.groups, "best_s": min(times[1:] or times),
           "median_s": statistics.median(times[1:] or times), "cold_s": times[0], "bytes": stats.bytes_moved,
           "wire_bytes": stats.wire_bytes, "share_bytes": sum(t.numel() * t.element_size() for t in model.values()),
           "peak_extra_bytes": stats.peak_extra_bytes, "warm_seconds": stats.seconds,
           "measured_peak_extra_bytes": (torch.cuda.max_memory_allocated(ns.device) - base) if cuda else None,
           "current_device": current, "current_device_extra_bytes": _memory(current) - base_current
           if current != ns.device else None}
    rx.close()
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of one case's rows (as printed, and as docs/benchmarks.md shows them):
    the warm cycles' median (and best); ratios: the raw READ's best (its other cycles were not
    recorded) over the median, the median over the staged row's median."""
    staged = next((r["median_s"] for r in rows if r["install"] == "staged"), rows[0]["staged_best_s"])
    lines = [("| install | budget | groups | warm ms median (best) | GB/s (median) | vs raw NIXL READ | vs staged "
              "| pull ms | extra MB (counted) | extra MB (measured) | equal |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        measured = "-" if r["measured_peak_extra_bytes"] is None else f"{r['measured_peak_extra_bytes'] / 1e6:.0f}"
        b = r["budget"]
        budget = "-" if b is None else b if b == "auto" else f"{b / 2**30:g} GiB" if b % 2**30 == 0 else f"{b / 1e6:g} MB"
        med = r["median_s"]
        lines.append(f"| {r['install']} | {budget} | {r['groups']} | {med * 1e3:.1f} ({r['best_s'] * 1e3:.1f}) "
                     f"| {r['bytes'] / med / 1e9:.1f} | {r['raw_best_s'] / med:.2f}x "
                     f"| {med / staged:.2f} | {r['warm_seconds'].get('pull', 0) * 1e3:.1f} "
                     f"| {r['peak_extra_bytes'] / 1e6:.0f} | {measured} "
                     f"| {r.get('equal_to_staged', '-')} |")
    return "\n".join(lines)


def checksum_summary(path: str) -> str:
    """One sentence: what verifying checksums costs per GB on the receiver (median cycle with
    checks less the median without, same install, per GB of the share) and on the trainer
    (its checksum pass per publish, slowest rank, per GB served), from one recorded run."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    recv, train = [], []
    for r in rows:
        if r["install"].endswith(" + checksums"):
            plain = next(p for p in rows if p["label"] == r["label"] and p["install"] == r["install"][:-12])
            recv.append((r["median_s"] - plain["median_s"]) / (r["share_bytes"] / 1e9) * 1e3)
            train.append(r["trainer_checksum_s"] / (r["trainer_served_bytes"] / 1e9) * 1e3)
    gpu = rows[0]["machine"].rsplit("GPU ", 1)[-1]
    return (f"Verifying checksums adds {min(recv):.1f}-{max(recv):.1f} ms per GB to a receiver's warm cycle and "
            f"{min(train):.1f}-{max(train):.1f} ms per GB served to each trainer publish (median cycles, "
            f"two {gpu} GPUs).")


def describe(r: dict) -> str:
    """One case's heading line."""
    return (f"machine: {r['machine']}\nmodel: {r['config']}, {r['layers']} layers, trainer tp={r['tp']} ep={r['ep']} "
            f"etp={r['etp']} {r['expert_layout']}, {r['quantization']}; trainers on {r['trainer_device']}, receiver "
            f"on {r['device']} (current device {r['current_device']}); target: {r['target']}; share "
            f"{r['share_bytes'] / 1e9:.3f} GB; raw NIXL READ of the same bytes {r['raw_best_s']:.4f} s, plain copy "
            f"{r['copy_best_s']:.4f} s" + ("" if not r.get("trainer_checksum_s") else
                                            f"; trainer checksums per publish {r['trainer_checksum_s'] * 1e3:.2f} ms "
                                            f"for {r['trainer_served_bytes'] / 1e9:.3f} GB served (slowest rank)"))


def _args(ns: argparse.Namespace) -> dict:
    args = {k: getattr(ns, k) for k in ("tp", "ep", "etp", "expert_layout", "vllm_tp", "vllm_ep", "quantization",
                                        "trainer_device", "checksums")}
    return {**args, "vllm_rank": 0, "dtype": "bfloat16", "param_buffer": True}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=0, help="expert tensor parallel size (0: tp)")
    ap.add_argument("--expert-layout", default="sequential", choices=["sequential", "te_grouped", "legacy_grouped"])
    ap.add_argument("--vllm-tp", type=int, default=0, help="receive vLLM worker 0's own shards (0: full HF tensors)")
    ap.add_argument("--vllm-ep", action="store_true", help="vLLM enable_expert_parallel")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--trainer-device", default="cpu")
    ap.add_argument("--device", default="cpu", help="the receiver's device (never made current here)")
    ap.add_argument("--budget", nargs="+", default=[str(2**30), "auto"], help="streamed budgets: bytes or auto")
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--checksums", action="store_true",
                    help="trainers publish checksums; adds staged and streamed receivers that verify them")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", help="append one JSON line per receiver")
    ap.add_argument("--from-json", help="print the tables of recorded results (a --json file) and exit")
    ap.add_argument("--summary", choices=["checksums"], help="with --from-json: one sentence, not the tables")
    return ap


def _print_recorded(path: str) -> int:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["machine"], r["label"], r["config"], r["quantization"], r["target"]), []).append(r)
    for group in cases.values():
        print(describe(group[0]) + "\n\n" + table(group) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench_nixl import _setup, raw_nixl_job, trainer

    from megarefit.demo.bench import bench_config, best_of, machine
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ns = _parser().parse_args(argv)
    if ns.from_json and ns.summary:
        print(checksum_summary(ns.from_json))
        return 0
    if ns.from_json:
        return _print_recorded(ns.from_json)
    cfg = bench_config(ns.config, ns.layers)
    args = _args(ns)
    dims, layout, _plan = _setup(cfg, args)
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job="bench")
    group = start_workers(trainer, world_size=len(layout.ranks()), args=(rdzv.port, cfg, args))
    rdzv.store.wait([f"bench/quantize/{r}" for r in range(len(layout.ranks()))], timedelta(seconds=600))
    want: dict = {}
    _run(rdzv, ns, None, want)  # the consumer's model: its names and shapes
    rows = [_run(rdzv, ns, None, {k: torch.empty_like(v) for k, v in want.items()})]
    for b in ns.budget:
        model = {k: torch.empty_like(v) for k, v in want.items()}
        row = _run(rdzv, ns, b if b == "auto" else int(float(b)), model)
        row["equal_to_staged"] = model.keys() == want.keys() and all(
            torch.equal(model[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
        rows.append(row)
    if ns.checksums:
        for b in [None, *ns.budget[:1]]:
            model = {k: torch.empty_like(v) for k, v in want.items()}
            row = _run(rdzv, ns, None if b is None else b if b == "auto" else int(float(b)), model, verify=True)
            row["equal_to_staged"] = all(torch.equal(model[k].view(torch.uint8), want[k].view(torch.uint8))
                                         for k in want)
            rows.append(row)
    sums = [json.loads(rdzv.store.get(f"bench/quantize/{r}").decode()) for r in range(len(layout.ranks()))]
    (raw_times, raw_bytes, _split), = start_workers(raw_nixl_job, world_size=1, args=(
        rdzv.port, len(layout.ranks()), ns.device, ns.cycles)).join(timeout=600)
    src = torch.ones(raw_bytes, dtype=torch.uint8, device=ns.device)
    dst = torch.empty_like(src)
    copy_best, _ = best_of(lambda: dst.copy_(src), ns.cycles, ns.device)
    rdzv.mark_consumed(1)
    group.join(timeout=300)
    target = (f"vLLM worker 0 of tp={ns.vllm_tp}" + (" EP" if ns.vllm_ep else "") if ns.vllm_tp
              else "full HF tensors") + (", block FP8" if ns.quantization == "fp8" else "")
    head = {"machine": machine(), "label": ns.label, "config": Path(ns.config).stem, "layers": dims.num_layers,
            "tp": layout.tp, "ep": layout.ep, "etp": layout.etp, "expert_layout": layout.expert_layout,
            "quantization": ns.quantization, "target": target, "trainer_device": ns.trainer_device,
            "device": ns.device, "raw_best_s": min(raw_times), "raw_bytes": raw_bytes, "copy_best_s": copy_best,
            "staged_best_s": rows[0]["best_s"],
            "trainer_checksum_s": max(s[2] for s in sums) if ns.checksums else None,
            "trainer_served_bytes": max(s[3] for s in sums)}
    rows = [{**head, **r} for r in rows]
    print(describe(rows[0]) + "\n\n" + table(rows), flush=True)
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0 if all(r.get("equal_to_staged", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
