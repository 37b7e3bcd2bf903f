"""A LoRA policy's refit, three ways, in one run: adapter-only vs merged vs full (bytes and seconds).

Two trainer ranks (tp 2, gloo, CPU, one process each) hold a dense GPT (Qwen3 layout, bf16) with every
decoder linear wrapped by Bridge ``LoRA`` (``to_wrap.weight`` and A / B, :mod:`megarefit.layout.lora`).
Each serves, over real NIXL (UCX on this host), both

* the **merged** weights: ``MergedLoRA.refresh()`` inside ``Publisher.updating`` (the adapter merged into
  served copies), pulled whole by a ``RefitReceiver``;
* the **adapter** alone: a ``LoraPublisher`` on channel ``lora/policy`` (its publish fingerprints the base),
  pulled into PEFT tensors by a ``LoraReceiver``.

A **full** refit of a trainer without LoRA pulls the same bytes as the merged one with nothing to merge:
its pull is the merged pull, its trainer side a plain publish (timed too). One receiver thread waits until
the trainers published a version both ways, then pulls it both ways (timed from there) and acknowledges; the trainers wait for the
acknowledgements before the next version. Medians with min-max over the warm versions (the first is cold:
plans, registrations) and both ranks; one torch thread a rank.

    python benchmarks/bench_lora_cycle.py [--layers 4] [--hidden 512] [--ranks 16 64] [--repeat 9]
                                          [--tp 2] [--device cpu] [--record docs/lora_cycle_cpu.jsonl]
    python benchmarks/bench_lora_cycle.py --from-json docs/lora_cycle_cpu.jsonl    # the recorded table
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path

from bench_lora_merge import model_args  # the script's folder is on sys.path
from recorded import recorded_main  # benchmarks/recorded.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_model(cfg: dict, r: int, tp: int, tp_rank: int):
    """One rank's parameters of the LoRA-wrapped model (every linear's base as ``to_wrap``), bf16."""
    import torch
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.dims import ModelDims
    from megarefit.layout.lora import adapter_local_shape
    from megarefit.specs.lora import LORA_ROWS

    dims = ModelDims.from_hf_config(cfg)
    shards = reference_shards(reference_hf_state(cfg, "qwen3", dtype=torch.bfloat16), cfg, tp=tp, pp=1)[(tp_rank, 0, 0)]
    params = {(n.replace(".weight", ".to_wrap.weight") if any(f".{x}.weight" in n for x in _LINEARS) else n): t
              for n, t in shards.items()}
    g = torch.Generator().manual_seed(tp_rank)
    for layer in range(dims.num_layers):
        for row in LORA_ROWS:
            shape = adapter_local_shape(row, dims, r, tp)
            params[row.megatron.format(layer=layer)] = (0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return dims, params


def job(rank: int, world_size: int, master_port: int, cfg: dict, r: int, repeat: int, port: int, job_name: str,
        device: str = "cpu"):
    import torch
    import torch.distributed as dist

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.lora_merge import MergedLoRA
    from megarefit.online.trainer.lora_publisher import LoraPublisher
    from megarefit.online.trainer.publisher import Publisher

    if device == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world_size)
    dims, params = lora_model(cfg, r, world_size, rank)
    params = {n: p.to(device) for n, p in params.items()}
    layout = source_layout(cfg, tp=world_size, pp=1)
    rdzv = Rendezvous.connect("127.0.0.1", port, job=job_name, timeout=120)
    merged = MergedLoRA(params, dims, alpha=2 * r, rank=r, tp=world_size, tp_rank=rank, tp_group=dist.group.WORLD)
    full = Publisher(merged.served, cfg, rank=(rank, 0, 0), layout=layout, rendezvous=rdzv,
                     agent_name=f"{job_name}-full-{rank}")
    adapter = LoraPublisher(params, cfg, rank=(rank, 0, 0), layout=layout, rendezvous=rdzv.channel("lora/policy"),
                            alpha=2 * r, base={n: p for n, p in params.items() if ".adapter." not in n},
                            agent_name=f"{job_name}-lora-{rank}")
    times: dict[str, list[float]] = {"merged": [], "adapter": [], "plain": [], "base_check": []}
    for v in range(1, repeat + 2):
        dist.barrier()
        t0 = time.perf_counter()
        with full.updating(v):
            merged.refresh()
        t1 = time.perf_counter()
        with adapter.updating(v):
            pass  # the optimizer step on the adapters; the publish checks the base and settles
        t2 = time.perf_counter()
        full.publish(v)  # the same version again: what a full-weight trainer's publish costs
        t3 = time.perf_counter()
        if v > 1:
            times["merged"].append(t1 - t0)
            times["adapter"].append(t2 - t1)
            times["plain"].append(t3 - t2)
            times["base_check"].append(adapter.last_base_check_s)
        full.wait_receivers(v, timeout=120)
        adapter.wait_receivers(v, timeout=120)
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, "base_bytes": sum(p.nbytes for n, p in params.items() if ".adapter." not in n)}


def _wait_published(channels: list, version: int, tp: int, timeout: float = 120.0) -> None:
    from megarefit.layout import RankCoord

    ranks, end = [RankCoord(t, 0, 0) for t in range(tp)], time.monotonic() + timeout
    while any(any(x is None or x < version for x in c.versions(ranks).values()) for c in channels):
        if time.monotonic() > end:
            raise TimeoutError(f"version {version} was not published in {timeout} s")
        time.sleep(0.001)


def _receive(rdzv, job_name: str, repeat: int, out: dict, device: str = "cpu", tp: int = 2) -> None:
    from megarefit.online.receiver.lora_receiver import LoraReceiver
    from megarefit.online.receiver.receiver import RefitReceiver

    full = RefitReceiver(rdzv, name=f"{job_name}-rx-full", timeout=120, device=device)
    lora = LoraReceiver(rdzv.channel("lora/policy"), name=f"{job_name}-rx-lora", timeout=120, device=device)
    pulls: dict[str, list[float]] = {"full": [], "adapter": []}
    stages: dict[str, list[float]] = {}  # the adapter cycle's stages (RefitReceiver's CycleStats.seconds)
    try:
        for v in range(1, repeat + 2):
            _wait_published([rdzv, rdzv.channel("lora/policy")], v, tp)  # the pulls are timed, not the trainers
            t0 = time.perf_counter()
            for _ in full.run_refit_cycle(v):
                pass
            t1 = time.perf_counter()
            adapter = lora.pull_adapter(v)
            t2 = time.perf_counter()
            full.acknowledge(v)
            lora.acknowledge(v)
            if v > 1:
                pulls["full"].append(t1 - t0)
                pulls["adapter"].append(t2 - t1)
                for k, x in lora.stats.seconds.items():
                    stages.setdefault(k, []).append(x)
        out.update(stages={k: statistics.median(x) for k, x in stages.items()}, ipc_launches=full.counters.get("ipc_launches", 0),pulls=pulls, full_bytes=full.stats.bytes_moved, adapter_bytes=lora.stats.bytes_moved,
                   peft_bytes=adapter.nbytes, tensors=len(adapter.tensors))
    except Exception as exc:  # noqa: BLE001 - reported by measure()
        out["error"] = repr(exc)
    finally:
        full.close()
        lora.close()


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _one(cfg: dict, r: int, repeat: int, tp: int = 2, device: str = "cpu") -> dict:
    from megarefit.demo.workers import run_workers
    from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous

    job_name = f"bench-lora-{r}-{os.getpid()}"
    os.environ[SECRET_ENV] = secrets.token_hex(16)  # the trainer processes inherit it
    rdzv = Rendezvous.serve(job=job_name)
    got: dict = {}
    rx = threading.Thread(target=_receive, args=(rdzv, job_name, repeat, got, device, tp), daemon=True)
    rx.start()
    per_rank = run_workers(job, world_size=tp, args=(cfg, r, repeat, rdzv.port, job_name, device), timeout=900)
    rx.join(120)
    if "error" in got or "pulls" not in got:
        raise RuntimeError(f"receiver failed: {got.get('error', 'no result')}")
    trainer = {k: _stats([t for p in per_rank for t in p["times"][k]]) for k in per_rank[0]["times"]}
    return {"r": r, "trainer": trainer, "pull": {k: _stats(v) for k, v in got["pulls"].items()},
            "full_bytes": got["full_bytes"], "adapter_bytes": got["adapter_bytes"], "peft_bytes": got["peft_bytes"],
            "tensors": got["tensors"], "adapter_stages": got["stages"], "base_bytes_per_rank": per_rank[0]["base_bytes"]}


def measure(ns) -> dict:
    from conftest import tiny_config

    from megarefit.demo.bench import machine

    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=ns.layers, hidden_size=ns.hidden, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=ns.hidden // 8, intermediate_size=3 * ns.hidden)
    rows = [_one(cfg, r, ns.repeat, ns.tp, ns.device) for r in ns.ranks]
    return {"rows": rows, "tp": ns.tp, "device": ns.device, "layers": ns.layers, "hidden": ns.hidden, "ffn": 3 * ns.hidden,
            "vocab": cfg["vocab_size"], "dtype": "bfloat16", "repeat": ns.repeat, "machine": machine(),
            "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


def print_table(res: dict) -> None:
    where = ("trainer ranks and receiver on one GPU (CUDA IPC)" if res.get("device", "cpu") != "cpu" else
             "real NIXL (UCX) on one host")
    print(f"One refit of a LoRA policy, three ways: tp {res['tp']} trainer ranks (gloo, one process a rank) and one "
          f"receiver, {where}; {res['layers']} layers, hidden {res['hidden']}, ffn {res['ffn']}, "
          f"vocab {res['vocab']}, every decoder linear wrapped by Bridge LoRA, {res['dtype']}; median (min-max) over "
          f"{res['repeat']} warm versions (trainer: x {res['tp']} ranks); {res['machine']}, {res['date']}"
          + (" (a 2-core machine: trainers and receiver share it)" if res.get("cores", 0) <= 2 else "") + ".\n")
    print("| r | way | trainer ms | pull ms | pulled MB | x adapter bytes |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in res["rows"]:
        t, p, a = row["trainer"], row["pull"], row["adapter_bytes"]
        ways = (("adapter only", t["adapter"], p["adapter"], a), ("merged", t["merged"], p["full"], row["full_bytes"]),
                ("full (no LoRA)", t["plain"], p["full"], row["full_bytes"]))
        for way, tr, pu, nbytes in ways:
            print(f"| {row['r']} | {way} | {_ms(tr)} | {_ms(pu)} | {nbytes / 1e6:.2f} | {nbytes / a:.0f} |")
    print()
    for row in res["rows"]:
        t, p = row["trainer"], row["pull"]
        print(f"At r {row['r']}, the adapter-only way moves {row['full_bytes'] / row['adapter_bytes']:.0f}x fewer bytes; "
              f"its trainer side takes {t['adapter']['median'] / t['merged']['median']:.2f}x a merged publish, its "
              f"pull {p['adapter']['median'] / p['full']['median']:.2f}x the full pull (medians).")
    last = res["rows"][-1]
    print(f"\nThe adapter-only trainer time is the publish with its base check "
          f"({last['trainer']['base_check']['median'] * 1e3:.1f} ms at r {last['r']}: the word sums of "
          f"{last['base_bytes_per_rank'] / 1e6:.1f} MB of frozen base per rank). The adapter pull moves "
          f"{last['adapter_bytes'] / 1e6:.2f} MB for {last['peft_bytes'] / 1e6:.2f} MB of PEFT tensors "
          f"({last['tensors']} tensors: LoRA's one A of linear_qkv / linear_fc1 is READ for each projection).")


def main() -> None:
    ap = model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--tp", type=int, default=2, help="trainer ranks (gloo: one GPU takes tp 1)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: trainers and receiver on one GPU")
    recorded_main(ap, measure, print_table)


if __name__ == "__main__":
    main()
