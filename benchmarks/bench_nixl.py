"""NIXL refit vs a raw NIXL transfer of the same bytes, trainers and receiver in separate processes.

Run from the repo root (CPU, UCX on loopback; ~1 min):

    python benchmarks/bench_nixl.py [--config tests/data/configs/Qwen3-0.6B.json] [--tp 2] [--cycles 5]

MoE layouts, vLLM-sharded targets and GPUs (trainers on one GPU, this receiver on another;
NIXL between processes over CUDA IPC where the machine has it):

    python benchmarks/bench_nixl.py --config tests/data/configs/Qwen3-30B-A3B.json --layers 8 --tp 2 \\
        --ep 2 --etp 1 --expert-layout te_grouped --vllm-tp 2 --vllm-ep --trainer-device cuda:0 --device cuda:1

One trainer process per Megatron rank serves random shards with the planned local shapes
through a real :class:`~megarefit.online.trainer.publisher.Publisher`, plus one extra registered block
holding exactly the bytes the receiver reads from that rank. The receiver (this process)
measures, in one run:

* ``refit cold``: the first ``RefitReceiver.run_refit_cycle`` (plan, allocate,
  register, prepare descriptors, pull);
* ``refit warm``: later cycles (plan cached, nothing registered, one prepared READ
  per trainer re-posted; includes the strided scratch copies);
* ``raw NIXL``: one prepared READ per trainer of its whole block as one descriptor,
  the same bytes, warm;
* ``plain copy``: ``copy_`` of the same bytes within this process, on its device.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _setup(cfg: dict, args: dict):
    """(dims, layout, plan) for the benchmark's arguments (trainers and receiver agree)."""
    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    dims = ModelDims.from_hf_config(cfg)
    tp = args["tp"]
    layout = SourceLayout.build(tp=tp, pp=1, ep=args["ep"], etp=args["etp"] or tp,
                                padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers,
                                expert_layout=args["expert_layout"])
    from megarefit.quant import Fp8Format
    from megarefit.quant.planning import plan_fp8

    fmt = Fp8Format() if args["quantization"] == "fp8" else None
    if args["vllm_tp"]:
        target = VllmTarget(args["vllm_tp"], args["vllm_rank"], expert_parallel=args["vllm_ep"])
        return dims, layout, plan_megatron_to_vllm(dims, layout, args["dtype"], target, fmt)
    plan = plan_megatron_to_hf(dims, layout, args["dtype"])
    return dims, layout, plan if fmt is None else plan_fp8(plan, fmt)


def trainer(index: int, _world_size: int, _port: int, rdzv_port: int, cfg: dict, args: dict) -> dict:
    from megarefit.layout.geometry import source_tensors
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher
    from megarefit.transport.nixl_agent import mem_type

    torch.set_num_threads(1)
    dims, layout, plan = _setup(cfg, args)
    coord = layout.ranks()[index]
    devices = args.get("trainer_devices") or [args["trainer_device"]]  # bench_multi.py: rank i on devices[i % n]
    device = devices[index % len(devices)]  # not made current: megarefit guards its own launches
    g = torch.Generator(device=device).manual_seed(index)
    shapes = {n: t.shape for n, t in source_tensors(dims, layout)[coord].items()}
    dtype = getattr(torch, args["dtype"])
    if args["param_buffer"]:  # as Megatron's DDP: every parameter a view of one contiguous buffer
        flat = torch.randn(sum(math.prod(s) for s in shapes.values()), generator=g, device=device, dtype=dtype)
        params, at = {}, 0
        for n, s in shapes.items():
            params[n] = flat[at:at + math.prod(s)].view(s)
            at += math.prod(s)
    else:
        params = {n: torch.randn(s, generator=g, device=device, dtype=dtype) for n, s in shapes.items()}
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job="bench")
    pub = Publisher(params, cfg, rank=coord, layout=layout, rendezvous=rdzv, agent_name=f"bench-trainer-{index}",
                    quantization=args["quantization"], checksums=bool(args.get("checksums")))
    nbytes = (args["raw_bytes"][index] if args.get("raw_bytes")  # bench_multi.py: the most any receiver reads here
              else plan.summary()["per_rank"].get(coord, {"bytes": 0})["bytes"])
    raw = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    pub.agent.register([raw])
    rdzv.store.set(f"bench/raw/{index}", json.dumps([raw.data_ptr(), nbytes, *mem_type(raw)]))
    rdzv.store.set(f"bench/meta/{index}", pub.agent.metadata)  # now includes the raw block
    pub.publish(1)
    quantize = []
    for _ in range(5 if pub.fp8 else 0):  # trainer-side FP8: re-quantize into the same buffers, as publish() does
        pub.publish(1)
        quantize.append(pub.last_quantize_s)
    sums = []
    for _ in range(5 if pub.checksums is not None else 0):  # trainer-side checksums per publish
        pub.publish(1)
        sums.append(pub.last_checksum_s)
    rdzv.store.set(f"bench/quantize/{index}", json.dumps(
        [min(quantize) if quantize else 0.0, sum(params[n].numel() * params[n].element_size() for n in pub.fp8),
         min(sums) if sums else 0.0, sum(t.nbytes for t in pub.manifest.tensors)]))
    rdzv.wait_consumed(1, timeout=1800)
    return {}


def raw_nixl_job(_index: int, _world_size: int, _port: int, rdzv_port: int, ranks: int, device: str,
                 cycles: int) -> tuple[list[float], int, dict[int, float]]:
    """Seconds of warm raw READs: each trainer's block as one descriptor, all posted at once
    (its own process: a second NIXL agent beside the receiver's would not measure the same path);
    and the best time of the same bytes cut into k equal descriptors per trainer (NIXL's
    per-descriptor cost)."""
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.transport.nixl_agent import NixlAgent, mem_type

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job="bench")
    raw_agent = NixlAgent("bench-raw-receiver", progress_thread=False)
    agent = raw_agent.agent
    blocks = []
    for r in range(ranks):
        addr, n, mem, dev = json.loads(rdzv.store.get(f"bench/raw/{r}").decode())
        name = agent.add_remote_agent(rdzv.store.get(f"bench/meta/{r}"))
        if n:
            blocks.append((name.decode() if isinstance(name, bytes) else name, addr, n, mem, dev))
    total = sum(b[2] for b in blocks)
    local = torch.empty(total, dtype=torch.uint8, device=device)
    raw_agent.register([local])
    lmem, ldev = mem_type(local)

    def requests(k: int) -> list:
        handles, at = [], 0
        for name, addr, n, mem, dev in blocks:
            cuts = [(i * n // k, (i + 1) * n // k) for i in range(k)]
            rh = agent.prep_xfer_dlist(name, [(addr + a, b - a, dev) for a, b in cuts], mem)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr() + at + a, b - a, ldev) for a, b in cuts],
                                       lmem)
            handles.append(agent.make_prepped_xfer("READ", lh, list(range(k)), rh, list(range(k))))
            at += n
        return handles

    def timed(handles: list) -> list[float]:
        times = []
        for _ in range(cycles + 1):
            t0 = time.perf_counter()
            for h in handles:
                agent.transfer(h)
            while any(agent.check_xfer_state(h) == "PROC" for h in handles):
                pass
            times.append(time.perf_counter() - t0)
        return times[1:]

    split = {k: min(timed(requests(k))) for k in (256, 1024, 4096)} if device.startswith("cuda") else {}
    return timed(requests(1)), total, split


def nccl_broadcast_job(index: int, world_size: int, port: int, nbytes: int, bucket: int, cycles: int,
                       devices: list[str] | None = None) -> list[float]:
    """Seconds per warm broadcast of ``nbytes`` from rank 0 to every other rank, in buckets of
    ``bucket`` bytes; rank i on ``devices[i]`` (default ``cuda:i``). vLLM's NCCL
    weight-transfer engine sends packed buckets; packing and unpacking are left out, so
    this is NCCL's best case for the same bytes."""
    import torch.distributed as dist

    device = devices[index] if devices else f"cuda:{index}"
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world_size)
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(cycles + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for at in range(0, nbytes, bucket):
            dist.broadcast(buf[at:at + bucket], src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times[1:]


def main() -> None:
    from megarefit.demo.bench import bench_config, machine, time_each
    from megarefit.demo.workers import start_workers
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=0, help="expert tensor parallel size (0: tp)")
    ap.add_argument("--expert-layout", default="sequential", choices=["sequential", "te_grouped", "legacy_grouped"])
    ap.add_argument("--vllm-tp", type=int, default=0, help="receive one vLLM worker's own shards (0: full HF tensors)")
    ap.add_argument("--vllm-rank", type=int, default=0)
    ap.add_argument("--vllm-ep", action="store_true", help="vLLM enable_expert_parallel")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"],
                    help="fp8: trainers publish block FP8 where blocks allow")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--trainer-device", default="cpu", help="where trainers keep their shards (cpu, cuda:0)")
    ap.add_argument("--device", default="cpu", help="where the receiver lands the pulls (cpu, cuda:1)")
    ap.add_argument("--receiver-threads", type=int, default=0, help="torch threads in the receiver (0: default)")
    ap.add_argument("--scratch-budget", type=float, default=0,
                    help="receiver scratch budget for gathered pulls, MB (0: the default, 5%% of the targets)")
    ap.add_argument("--direct-min", type=int, default=0,
                    help="smallest pull READ straight into its target, bytes (0: the transport's default)")
    ap.add_argument("--nccl-bucket", type=float, default=1024,
                    help="NCCL broadcast baseline bucket, MB (GPU receivers only; 0: skip)")
    ap.add_argument("--separate-params", action="store_true",
                    help="allocate every trainer parameter on its own (default: views of one buffer, as Megatron DDP)")
    ap.add_argument("--profile-cold", type=int, default=0, help="print the N costliest calls of the cold cycle")
    ap.add_argument("--label", default="", help="a name for this case in the JSON line")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--from-json", help="print the table of recorded results (a --json file) and exit")
    ap.add_argument("--summary", choices=["nixl", "fp8", "targets"],
                    help="with --from-json: one sentence (see recorded_summary), not the table")
    ns = ap.parse_args()
    if ns.from_json:
        print(recorded_summary(ns.from_json, ns.summary)) if ns.summary else print_recorded(ns.from_json)
        return
    if ns.receiver_threads:
        torch.set_num_threads(ns.receiver_threads)
    cfg = bench_config(ns.config, ns.layers)
    args = {k: getattr(ns, k) for k in ("tp", "ep", "etp", "expert_layout", "vllm_tp", "vllm_rank", "vllm_ep", "dtype",
                                        "trainer_device", "quantization")}
    args["param_buffer"] = not ns.separate_params
    dims, layout, plan = _setup(cfg, args)
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job="bench")
    group = start_workers(trainer, world_size=len(layout.ranks()), args=(rdzv.port, cfg, args))
    t_ctor = time.perf_counter()
    receiver = RefitReceiver(rdzv, name="bench-receiver", timeout=180, device=ns.device, target=(
        None if not ns.vllm_tp else plan_target(ns)), scratch_budget=int(ns.scratch_budget * 1e6) or None)
    t_ctor = time.perf_counter() - t_ctor
    if ns.direct_min:
        receiver.transport.direct_min_bytes = ns.direct_min
    t_ready = time.perf_counter()  # the cold cycle starts once every trainer published: it times the receiver
    rdzv.store.wait([f"bench/quantize/{r}" for r in range(len(layout.ranks()))], timedelta(seconds=600))
    t_ready = time.perf_counter() - t_ready
    cycles = []
    for i in range(ns.cycles):
        prof = None
        if i == 0 and ns.profile_cold:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for _name, _tensor in receiver.run_refit_cycle(1):
            pass
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(ns.profile_cold)
        if ns.device.startswith("cuda"):
            torch.cuda.synchronize(ns.device)
        cycles.append((time.perf_counter() - t0, receiver.stats))
    stats = cycles[-1][1]
    # the refit's direct READs alone (its prepared requests, no scratch waves): their rate against
    # the raw one-descriptor READ's tells descriptor shapes from the rest of the cycle
    prepared = receiver.transport.prepared[0]
    direct = [p for p in prepared.per_source if p.handle is not None]
    direct_bytes = sum(p.wire_bytes - sum(w.nbytes for w in p.waves) for p in direct)
    direct_desc = sum(p.descriptors - sum(w.descriptors for w in p.waves) for p in direct)
    direct_times = []
    agent = receiver.transport.nixl.agent
    for _ in range(ns.cycles if direct else 0):
        t0 = time.perf_counter()
        for p in direct:
            agent.transfer(p.handle)
        while any(agent.check_xfer_state(p.handle) == "PROC" for p in direct):
            pass
        direct_times.append(time.perf_counter() - t0)
    del receiver.transport  # one NIXL agent per process at a time
    (raw_times, raw_bytes, split), = start_workers(raw_nixl_job, world_size=1, args=(
        rdzv.port, len(layout.ranks()), ns.device, ns.cycles)).join(timeout=600)
    src = torch.ones(raw_bytes, dtype=torch.uint8, device=ns.device)
    dst = torch.empty_like(src)
    copy_times = time_each(lambda: dst.copy_(src), ns.cycles, ns.device)
    copy_best, copy_median = min(copy_times), statistics.median(copy_times)
    nccl = []
    if ns.device.startswith("cuda") and ns.nccl_bucket and torch.cuda.device_count() >= 2:
        nccl, = start_workers(nccl_broadcast_job, world_size=2, args=(
            stats.bytes_moved, int(ns.nccl_bucket * 2**20), ns.cycles)).join(timeout=600)[1:]
    quant = [json.loads(rdzv.store.get(f"bench/quantize/{r}").decode()) for r in range(len(layout.ranks()))]
    rdzv.mark_consumed(1)
    group.join(timeout=300)

    nbytes = stats.bytes_moved
    warm = [t for t, _ in cycles[1:]]
    pull = [s.seconds["pull"] for _, s in cycles[1:]]
    read = [s.seconds["pull.read"] for _, s in cycles[1:]]
    best_raw = min(raw_times)
    full = sum(m.numel for m in _full_plan(dims, layout, ns.dtype).targets.values()) * torch.empty(
        (), dtype=getattr(torch, ns.dtype)).element_size()
    target = (f"vLLM worker {ns.vllm_rank} of tp={ns.vllm_tp}" + (" EP" if ns.vllm_ep else "")
              if ns.vllm_tp else "full HF tensors") + (", block FP8" if ns.quantization == "fp8" else "")
    summary = plan.summary()["total"]
    print(f"machine: {machine()}")
    print(f"model: {Path(ns.config).stem}, {dims.num_layers} layers, trainer tp={layout.tp} ep={layout.ep} "
          f"etp={layout.etp} {layout.expert_layout}, {len(layout.ranks())} trainer processes on "
          f"{ns.trainer_device}, receiver on {ns.device}, {ns.dtype}; target: {target}")
    print(f"bytes moved {nbytes / 1e9:.3f} GB (full model {full / 1e9:.3f} GB: {nbytes / full:.2f}x; "
          f"on the wire {stats.wire_bytes / 1e9:.3f} GB); "
          f"{summary['ops']} ops ({summary['contiguous']} contiguous, {summary['scratch']} scratch); "
          f"raw block bytes {raw_bytes / 1e9:.3f} GB")
    print(f"receiver: {stats.descriptors} READ descriptors per cycle; arena {stats.arena_bytes / 1e9:.3f} GB, "
          f"scratch {stats.scratch_bytes / 1e6:.1f} MB ({stats.scratch_bytes / max(1, stats.arena_bytes):.1%} "
          f"of the arena)")
    print("| path | best s | median s | GB/s (best) | vs raw NIXL |")
    print("|---|---:|---:|---:|---:|")
    rows = [("refit cold cycle (plan, alloc, register, prepare, pull)", [cycles[0][0]]),
            ("refit warm cycle (whole cycle)", warm), ("refit warm: pull stage", pull),
            ("refit warm: READs only", read), ("raw NIXL READ, same bytes, one block per trainer", raw_times),
            *[(f"raw NIXL READ, same bytes, {k} descriptors per trainer", [t]) for k, t in split.items()],
            *([(f"NCCL broadcast GPU0 -> GPU1, same bytes, {ns.nccl_bucket:g} MB buckets", nccl)] if nccl else []),
            ("plain copy in the receiver, same bytes", [copy_best, copy_median])]
    for name, ts in rows:
        print(f"| {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {nbytes / min(ts) / 1e9:.2f} | "
              f"{best_raw / min(ts):.2f}x |")
    if ns.quantization == "fp8":
        print(f"trainer-side FP8 quantization per publish (slowest rank): {max(q[0] for q in quant) * 1e3:.2f} ms for "
              f"{max(q[1] for q in quant) / 1e9:.3f} GB of bf16 shards")
    print("warm stage seconds:", {k: round(v, 4) for k, v in stats.seconds.items()})
    if direct_times:
        rate = direct_bytes / min(direct_times[1:] or direct_times)
        print(f"the refit's direct READs alone: {direct_desc} descriptors, {direct_bytes / 1e9:.3f} GB in "
              f"{min(direct_times[1:] or direct_times) * 1e3:.2f} ms: {rate / 1e9:.1f} GB/s, "
              f"{rate / (raw_bytes / best_raw):.2f}x of the raw one-descriptor READ's rate")
    print(f"receiver constructor (NIXL agent, kernel warm-up): {t_ctor:.3f} s; then waited {t_ready:.3f} s for "
          f"the trainers to publish (not in the cold cycle)")
    print("cold stage seconds:", {k: round(v, 4) for k, v in cycles[0][1].seconds.items()})
    print("counters after last cycle:", dict(stats.counters))
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"config": Path(ns.config).stem, "layers": dims.num_layers, "tp": layout.tp,
                                "ep": layout.ep, "etp": layout.etp, "expert_layout": layout.expert_layout,
                                "target": target, "bytes": nbytes, "wire_bytes": stats.wire_bytes, "full_bytes": full,
                                "ops": summary,
                                "warm_best": min(warm), "warm_median": statistics.median(warm),
                                "read_best": min(read), "raw_best": best_raw, "copy_best": copy_best,
                                "nccl_best": min(nccl) if nccl else None, "raw_split": split, "label": ns.label,
                                "descriptors": stats.descriptors,
                                "arena_bytes": stats.arena_bytes, "scratch_bytes": stats.scratch_bytes,
                                "cold": cycles[0][0], "warm_seconds": stats.seconds, "quantization": ns.quantization,
                                "trainer_quantize_s": max(q[0] for q in quant), "machine": machine(),
                                "samples": {"warm": warm, "pull": pull, "read": read, "raw": raw_times,
                                            "nccl": list(nccl), "copy": copy_times},
                                "date": time.strftime("%Y-%m-%d")}) + "\n")


def case_name(r: dict) -> str:
    """A recorded case in words: model, trainer layout, FP8, the vLLM worker if one."""
    name = f"{r['config']} tp{r['tp']}"
    if r["ep"] > 1 or r["etp"] != r["tp"]:
        name += (f" ep{r['ep']}" if r["ep"] > 1 else "") + f" etp{r['etp']} {r['expert_layout']}"
    elif r["config"].endswith(("A3B", "A22B")) or "x7B" in r["config"]:
        name += f" etp{r['etp']} {r['expert_layout']}"
    name += ", FP8" if r.get("quantization") == "fp8" else ""
    return name + (f" -> {r['target']}" if r["target"].startswith("vLLM") else "")


def _med(r: dict, key: str) -> float | None:
    """Median seconds of path ``key`` (warm, pull, raw, nccl, copy) in a record: from every
    recorded cycle where the record has them; else the recorded median (warm) or, for a
    baseline whose cycles were not recorded, its best (older records: a stricter baseline)."""
    if "samples" in r:
        return statistics.median(r["samples"][key]) if r["samples"].get(key) else None
    return {"warm": r["warm_median"], "pull": r["warm_seconds"]["pull"], "raw": r["raw_best"],
            "nccl": r.get("nccl_best"), "copy": r["copy_best"]}[key]


def _spread(r: dict, key: str) -> str:
    ts = r.get("samples", {}).get(key)
    return f"{statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})" if ts else \
        f"{_med(r, key) * 1e3:.1f}"


def load_recorded(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def print_recorded(path: str) -> None:
    """The table of a ``--json`` file (``benchmarks/run_refit_gpu.sh`` writes one line per case):
    medians, and min-max where every cycle was recorded; ratios are baseline over refit."""
    rows = load_recorded(path)
    machines = sorted({f"{r['machine']}, {r['date']}" if "machine" in r else
                       "not recorded in this file (see the text)" for r in rows})
    print("machine: " + "; ".join(machines) + "\n")
    if all("samples" in r for r in rows):
        n = min(len(r["samples"]["warm"]) for r in rows)
        print(f"ms: median (min-max) of {n}+ warm cycles; ratios: median baseline / median refit\n")
    else:
        print("ms: the warm cycle's median; raw NIXL, NCCL: best of the cycles (their other cycles were not "
              "recorded); ratios: that baseline / the refit's median\n")
    print("| case | GB placed | READ descriptors | scratch MB (of arena) | warm ms | pull ms | raw NIXL ms | NCCL ms "
          "| **warm vs raw NIXL** | pull vs raw NIXL | raw NIXL vs NCCL | cold s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        raw, warm, pull, nccl = _med(r, "raw"), _med(r, "warm"), _med(r, "pull"), _med(r, "nccl")
        scratch = f"{r['scratch_bytes'] / 1e6:.0f}" if r["scratch_bytes"] >= 1e6 else f"{r['scratch_bytes'] / 1e6:.1f}"
        nccl_ms, nccl_ratio = (_spread(r, "nccl"), f"{nccl / raw:.2f}x") if nccl else ("-", "-")
        print(f"| {case_name(r)} | {r['bytes'] / 1e9:.2f} | {r['descriptors']} | {scratch} "
              f"({100 * r['scratch_bytes'] / r['arena_bytes']:.1f}%) | {_spread(r, 'warm')} | {_spread(r, 'pull')} | "
              f"{_spread(r, 'raw')} | {nccl_ms} | **{raw / warm:.2f}x** | {raw / pull:.2f}x | {nccl_ratio} | "
              f"{r['cold']:.3f} |")


def recorded_summary(path: str, what: str = "nixl") -> str:
    """One sentence for the README from one recorded run: ``nixl``, the warm cycle against a
    raw NIXL READ of the same bytes (dense, MoE, legacy GroupedMLP apart) and NCCL; ``fp8``,
    FP8 against bf16 per layout; ``targets``, a vLLM-sharded worker against full HF tensors."""
    rows = load_recorded(path)
    bf16 = [r for r in rows if r.get("quantization", "none") == "none"]
    gpu = rows[0]["machine"].rsplit("GPU ", 1)[-1]
    when = f"median of {min(len(r['samples']['warm']) for r in rows)} warm cycles, two {gpu} GPUs, {rows[0]['date']}"

    def span(rs: list[dict]) -> str:
        v = [_med(r, "raw") / _med(r, "warm") for r in rs]
        return f"{min(v):.2f}x" if f"{min(v):.2f}" == f"{max(v):.2f}" else f"{min(v):.2f}-{max(v):.2f}x"

    if what == "fp8":
        pairs = [(r, b) for r in rows for b in bf16 if r.get("quantization") == "fp8"
                 and case_name(b) + ", FP8" == case_name(r)]
        return "An FP8 refit takes " + ", ".join(f"{_med(r, 'warm') / _med(b, 'warm'):.2f}x ({case_name(b)})"
                                                 for r, b in pairs) + f" of the bf16 refit's time ({when})."
    if what == "targets":
        out = []
        for r in bf16:
            full = [b for b in bf16 if not b["target"].startswith("vLLM") and r["target"].startswith("vLLM")
                    and case_name(b) == case_name(r).split(" -> ")[0]]
            if full:
                out.append(f"{case_name(r)}: {_med(r, 'warm') * 1e3:.1f} ms per warm refit vs "
                           f"{_med(full[0], 'warm') * 1e3:.1f} ms for full HF tensors")
        return "; ".join(out) + f" ({when})."
    dense = [r for r in bf16 if r["ep"] == 1 and r["etp"] == r["tp"] and not r["config"].endswith("A3B")]
    legacy = [r for r in bf16 if r["expert_layout"] == "legacy_grouped"]
    moe = [r for r in bf16 if r not in dense and r not in legacy]
    nccl = [_med(r, "raw") / _med(r, "nccl") for r in bf16 if _med(r, "nccl")]
    text = (f"A warm refit cycle over NIXL runs at {span(dense)} (dense), {span(moe)} (MoE, vLLM-sharded targets "
            f"included) and {span(legacy)} (legacy GroupedMLP) of a raw NIXL READ of the same bytes ({when})")
    return text + (f"; an NCCL broadcast of those bytes runs at {min(nccl):.2f}-{max(nccl):.2f}x of the raw READ"
                   if nccl else "") + "."


def plan_target(ns: argparse.Namespace):
    from megarefit.targets import VllmTarget

    return VllmTarget(ns.vllm_tp, ns.vllm_rank, expert_parallel=ns.vllm_ep)


def _full_plan(dims, layout, dtype):
    from megarefit.planner import plan_megatron_to_hf

    return plan_megatron_to_hf(dims, layout, dtype)


if __name__ == "__main__":
    main()
