"""Refit at scale: trainer ranks over several GPUs, one vLLM engine's workers pulling at once.

Issue 14's run (nvidia-h200-x8: trainers on GPUs 0-3, a vLLM tp=4 engine on GPUs 4-7)::

    python benchmarks/bench_multi.py --config tests/data/configs/Llama-3.1-70B.json --tp 4 \\
        --trainer-devices cuda:0 cuda:1 cuda:2 cuda:3 --vllm-tp 4 --receiver-devices cuda:4 cuda:5 cuda:6 cuda:7
    python benchmarks/bench_multi.py --config tests/data/configs/Qwen3-30B-A3B.json --tp 2 --ep 2 --etp 1 \\
        --expert-layout te_grouped --trainer-devices cuda:0 cuda:1 cuda:2 cuda:3 --vllm-tp 4 --vllm-ep \\
        --receiver-devices cuda:4 cuda:5 cuda:6 cuda:7

(``benchmarks/run_refit_8gpu.sh`` runs both, bf16 and FP8.) Every party is its own
process: trainer rank ``i`` serves random shards of the real shapes from
``--trainer-devices[i % n]`` through a real Publisher (parameters as views of one buffer,
as Megatron's DDP keeps them); receiver ``r`` is worker ``r`` of a vLLM ``tp = --vllm-tp``
engine (``RefitReceiver(target=VllmTarget(...))``: it pulls only its own shards) on
``--receiver-devices[r % n]``. All receivers start each cycle together.

Reported, for the same run: seconds per warm refit (the slowest receiver of a cycle),
aggregate GB/s (every receiver's bytes / that), bytes per worker, the cold first cycle;
raw NIXL READ of the same bytes (each receiver reads its share from each trainer as one
descriptor, all receivers at once); NCCL broadcast of the whole model from trainer GPU 0
to every receiver GPU in 1 GiB buckets (vLLM's NCCL weight-transfer engine: every worker
receives every tensor; packing left out, so NCCL's best case).
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


def _target(args: dict, rank: int):
    from megarefit.targets import VllmTarget

    return VllmTarget(args["vllm_tp"], rank, expert_parallel=args["vllm_ep"])


def _plans(cfg: dict, args: dict) -> tuple[object, object, list]:
    """(dims, layout, one plan per receiver) as the receivers will build them."""
    from bench_nixl import _setup

    from megarefit.quant import Fp8Format
    from megarefit.targets import plan_megatron_to_vllm

    dims, layout, _ = _setup(cfg, args | {"vllm_tp": 0, "quantization": "none"})
    fmt = Fp8Format() if args["quantization"] == "fp8" else None
    return dims, layout, [plan_megatron_to_vllm(dims, layout, args["dtype"], _target(args, r), fmt)
                          for r in range(args["vllm_tp"])]


def receiver_job(index: int, world: int, _port: int, rdzv_port: int, ranks: int, args: dict) -> dict:
    """vLLM worker ``index``: timed refit cycles when told (``multi/go/<c>``), then timed raw
    READs of its share (``multi/raw/<c>``)."""
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.transport.nixl_agent import NixlAgent, mem_type

    devices = args["receiver_devices"]
    device = devices[index % len(devices)]  # not made current: megarefit guards its own launches
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job="bench")
    store = rdzv.store
    t0 = time.perf_counter()
    rx = RefitReceiver(rdzv, name=f"multi-rx-{index}", timeout=300, device=device, target=_target(args, index))
    ctor = time.perf_counter() - t0
    store.wait([f"bench/quantize/{r}" for r in range(ranks)], timedelta(seconds=900))  # every trainer published
    store.set(f"multi/ready/{index}", "1")
    out: dict = {"ctor": ctor, "cycles": [], "raw": []}
    for c in range(args["cycles"]):
        store.wait([f"multi/go/{c}"], timedelta(seconds=900))
        t0 = time.perf_counter()
        for _ in rx.run_refit_cycle(1):
            pass
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        out["cycles"].append(time.perf_counter() - t0)
        store.set(f"multi/done/{index}/{c}", "1")
    stats, plan = rx.stats, rx.plan
    out.update(bytes=stats.bytes_moved, wire=stats.wire_bytes, descriptors=stats.descriptors,
               warm_stages=stats.seconds)
    per_rank = {tuple(r): v["bytes"] for r, v in plan.summary()["per_rank"].items() if r is not None}
    del rx.transport  # one NIXL agent per process at a time
    raw = NixlAgent(f"multi-raw-{index}", progress_thread=False)
    agent, blocks = raw.agent, []
    for r in range(ranks):
        addr, _, mem, dev = json.loads(store.get(f"bench/raw/{r}").decode())
        coord = tuple(json.loads(store.get(f"multi/coord/{r}").decode()))
        name = agent.add_remote_agent(store.get(f"bench/meta/{r}"))
        if per_rank.get(coord):
            blocks.append((name.decode() if isinstance(name, bytes) else name, addr, per_rank[coord], mem, dev))
    local = torch.empty(max(1, sum(b[2] for b in blocks)), dtype=torch.uint8, device=device)
    raw.register([local])
    lmem, ldev = mem_type(local)
    handles, at = [], 0
    for name, addr, n, mem, dev in blocks:
        rh = agent.prep_xfer_dlist(name, [(addr, n, dev)], mem)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr() + at, n, ldev)], lmem)
        handles.append(agent.make_prepped_xfer("READ", lh, [0], rh, [0]))
        at += n
    store.set(f"multi/raw_ready/{index}", "1")
    for c in range(args["cycles"]):
        store.wait([f"multi/raw/{c}"], timedelta(seconds=900))
        t0 = time.perf_counter()
        for h in handles:
            agent.transfer(h)
        while any(agent.check_xfer_state(h) == "PROC" for h in handles):
            pass
        out["raw"].append(time.perf_counter() - t0)
        store.set(f"multi/raw_done/{index}/{c}", "1")
    store.wait(["multi/finish"], timedelta(seconds=900))
    return out


def print_recorded(path: str) -> None:
    """The table of a ``--json`` file: per run, the workers' shares, the slowest worker's warm
    cycle, the aggregate rate, and the raw NIXL READ of the same shares (both at once)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print("machine: " + "; ".join(sorted({r.get("machine", "not recorded in this file (see the text)")
                                          for r in rows})) + "\n")
    print("warm: the slowest worker's median cycle; raw NIXL: best of its cycles (the others were not recorded); "
          "ratio: that best over the median\n")
    print("| model -> engine | bytes per worker | descriptors per worker | warm s (slowest worker, median) "
          "| aggregate GB/s | raw NIXL s (best) | **vs raw** | cold s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        moe = f" ep{r['ep']} {r['expert_layout']}" if r["ep"] > 1 else ""
        case = (f"{r['config']} ({r['layers']} layers) tp{r['tp']}{moe}{', FP8' if r['quantization'] == 'fp8' else ''}"
                f" -> vLLM tp{r['vllm_tp']}{' EP' if r['vllm_ep'] else ''}")
        share = ", ".join(f"{b / 1e9:.2f}" for b in sorted(set(r["bytes_per_worker"])))
        warm = r["warm_median"]
        print(f"| {case} | {share} GB | {', '.join(map(str, r['descriptors']))} | {warm:.4f} | "
              f"{r['model_bytes'] / warm / 1e9:.1f} | {r['raw_best']:.4f} | "
              f"**{r['raw_best'] / warm:.2f}x** | {r['cold']:.3f} |")


def main() -> None:
    from bench_nixl import nccl_broadcast_job, trainer

    from megarefit.demo.bench import bench_config, machine
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret
    from megarefit.planner import plan_megatron_to_hf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=0, help="expert TP (0: = tp)")
    ap.add_argument("--expert-layout", default="sequential", choices=["sequential", "te_grouped", "legacy_grouped"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--trainer-devices", nargs="+", default=["cpu"], help="trainer rank i on device i %% n")
    ap.add_argument("--vllm-tp", type=int, default=2, help="receivers: the workers of one vLLM engine of this tp")
    ap.add_argument("--vllm-ep", action="store_true", help="vLLM expert parallelism (each worker: its experts)")
    ap.add_argument("--receiver-devices", nargs="+", default=["cpu"], help="receiver r on device r %% n")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--nccl-bucket", type=float, default=1024, help="NCCL baseline bucket, MB (0: skip)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--from-json", help="print the table of recorded results (a --json file) and exit")
    ns = ap.parse_args()
    if ns.from_json:
        print_recorded(ns.from_json)
        return
    cfg = bench_config(ns.config, ns.layers)
    args = {"tp": ns.tp, "ep": ns.ep, "etp": ns.etp, "expert_layout": ns.expert_layout, "vllm_tp": ns.vllm_tp,
            "vllm_rank": 0, "vllm_ep": ns.vllm_ep, "dtype": ns.dtype, "trainer_device": ns.trainer_devices[0],
            "trainer_devices": ns.trainer_devices, "quantization": ns.quantization, "param_buffer": True,
            "receiver_devices": ns.receiver_devices, "cycles": ns.cycles}
    dims, layout, plans = _plans(cfg, args)
    ranks = layout.ranks()
    shares = [p.summary()["per_rank"] for p in plans]
    args["raw_bytes"] = [max(s.get(r, {"bytes": 0})["bytes"] for s in shares) for r in ranks]
    args["vllm_tp"] = 0  # the trainers' own _setup: the HF plan (its FP8 decisions are the vLLM plans' too)
    trainer_args = dict(args)
    args["vllm_tp"] = ns.vllm_tp
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job="bench")
    for i, r in enumerate(ranks):
        rdzv.store.set(f"multi/coord/{i}", json.dumps(list(r)))
    trainers = start_workers(trainer, world_size=len(ranks), args=(rdzv.port, cfg, trainer_args))
    receivers = start_workers(receiver_job, world_size=ns.vllm_tp, args=(rdzv.port, len(ranks), args))
    store = rdzv.store
    store.wait([f"multi/ready/{r}" for r in range(ns.vllm_tp)], timedelta(seconds=900))
    for c in range(ns.cycles):
        store.set(f"multi/go/{c}", "1")
        store.wait([f"multi/done/{r}/{c}" for r in range(ns.vllm_tp)], timedelta(seconds=900))
    store.wait([f"multi/raw_ready/{r}" for r in range(ns.vllm_tp)], timedelta(seconds=900))
    for c in range(ns.cycles):
        store.set(f"multi/raw/{c}", "1")
        store.wait([f"multi/raw_done/{r}/{c}" for r in range(ns.vllm_tp)], timedelta(seconds=900))
    store.set("multi/finish", "1")
    results = receivers.join(timeout=900)
    rdzv.mark_consumed(1)
    trainers.join(timeout=300)
    hf_plan = plan_megatron_to_hf(dims, layout, ns.dtype)
    full = hf_plan.nbytes
    if ns.quantization == "fp8":  # what an NCCL engine would send: the whole model as trainers serve it
        from megarefit.quant import Fp8Format
        from megarefit.quant.planning import plan_fp8

        full_sent = plan_fp8(hf_plan, Fp8Format()).nbytes
    else:
        full_sent = full
    nccl = []
    if ns.nccl_bucket and ns.receiver_devices[0].startswith("cuda"):
        devices = [ns.trainer_devices[0]] + [ns.receiver_devices[r % len(ns.receiver_devices)]
                                             for r in range(ns.vllm_tp)]
        if len(set(devices)) == len(devices):  # NCCL needs one GPU per rank
            nccl = start_workers(nccl_broadcast_job, world_size=len(devices), args=(
                full_sent, int(ns.nccl_bucket * 2**20), ns.cycles,
                devices)).join(timeout=600)[0]

    per_cycle = [max(r["cycles"][c] for r in results) for c in range(ns.cycles)]
    raw_cycle = [max(r["raw"][c] for r in results) for c in range(ns.cycles)]
    warm = per_cycle[1:] or per_cycle
    total = sum(r["bytes"] for r in results)
    best_raw = min(raw_cycle)
    print(f"machine: {machine()}")
    print(f"model: {Path(ns.config).stem}, {dims.num_layers} layers, trainer tp={layout.tp} ep={layout.ep} "
          f"etp={layout.etp} {layout.expert_layout}, {len(ranks)} trainer processes on {ns.trainer_devices}; "
          f"vLLM tp={ns.vllm_tp}{' EP' if ns.vllm_ep else ''} on {ns.receiver_devices}; {ns.dtype}"
          f"{', block FP8' if ns.quantization == 'fp8' else ''}")
    print(f"bytes per worker: {[round(r['bytes'] / 1e9, 3) for r in results]} GB (model {full / 1e9:.3f} GB); "
          f"descriptors per worker: {[r['descriptors'] for r in results]}")
    print("| path | best s | median s | aggregate GB/s (best) | vs raw NIXL |")
    print("|---|---:|---:|---:|---:|")
    rows = [("refit cold cycle (slowest worker)", per_cycle[:1]), ("refit warm cycle (slowest worker)", warm),
            ("raw NIXL READ, same bytes, one descriptor per (worker, trainer)", raw_cycle)]
    if nccl:
        what = "FP8 model" if ns.quantization == "fp8" else "model"
        rows.append((f"NCCL broadcast of the {what} to every worker, {ns.nccl_bucket:g} MB buckets", nccl))
    for name, ts in rows:
        print(f"| {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {total / min(ts) / 1e9:.2f} | "
              f"{best_raw / min(ts):.2f}x |")
    print(f"receiver constructors: {max(r['ctor'] for r in results):.3f} s (slowest)")
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"config": Path(ns.config).stem, "layers": dims.num_layers, "tp": layout.tp,
                                "ep": layout.ep, "etp": layout.etp, "expert_layout": layout.expert_layout,
                                "vllm_tp": ns.vllm_tp, "vllm_ep": ns.vllm_ep, "quantization": ns.quantization,
                                "trainer_devices": ns.trainer_devices, "receiver_devices": ns.receiver_devices,
                                "bytes_per_worker": [r["bytes"] for r in results], "model_bytes": full,
                                "cold": per_cycle[0], "warm_best": min(warm), "warm_median": statistics.median(warm),
                                "raw_best": best_raw, "nccl_best": min(nccl) if nccl else None,
                                "descriptors": [r["descriptors"] for r in results], "machine": machine(),
                                "date": time.strftime("%Y-%m-%d"),
                                "samples": {"warm": warm, "raw": list(raw_cycle), "nccl": list(nccl or [])}}) + "\n")


if __name__ == "__main__":
    main()
