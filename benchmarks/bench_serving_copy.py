"""What serving costs a data-parallel copy of a Megatron-Core trainer (issue 58): memory and time
on a copy-1 rank, ``serve_copies=True`` against ``serve_copies=False``, in one run.

Four real Megatron-Core processes (gloo, CPU: dp2 x tp2) train a bf16 GPT (``--hidden``,
``--layers``, ``--vocab``; Qwen3 layout) with Megatron's DDP and ``DistributedOptimizer``. Each
configuration builds ``Publisher.from_megatron`` on every rank, then runs ``--steps`` training
steps (forward, backward, gradient sync outside; ``optimizer.step()`` inside
``Publisher.updating``, as the docs ask). Measured on each copy-1 rank, per configuration:

* ``setup_s``: ``from_megatron`` (reading the layout, NIXL registration, buffers, manifest);
* ``rss_delta`` / ``peak_delta``: process RSS after setup minus before, and the peak RSS during
  setup minus RSS before (``/proc/self/status`` VmRSS / VmHWM, the peak reset first);
* ``registered``: bytes registered with NIXL (``agent.counters``: the parameter buffer registers
  whole, Megatron DDP's padding included); ``extra``: bytes of buffers the options allocated;
* ``enter_s`` + ``exit_s``: the per-step cost of ``updating()`` around the optimizer step
  (marking the rank writing; settling, FP8 quantizing / snapshot / checksums, publishing);
* ``step_s``: the whole training step, and ``opt_s``: ``optimizer.step()`` alone.

Configurations: ``off`` (``serve_copies=False``: copy 1 gets an empty group), ``on`` (plain),
``checksums``, ``snapshot``, ``fp8`` (block FP8 buffers, quantized by the PyTorch path on CPU),
``delta`` (a host mirror: no tracker). No receiver reads during the steps (on CPU the cost of a
served READ to the trainer is UCX's progress thread and memory bandwidth, not measured here).
Worker processes run with ``MALLOC_MMAP_THRESHOLD_`` fixed (default 128 KiB), so freed tensors
leave the RSS and configurations run one after another in the same processes measure apart.

    python benchmarks/bench_serving_copy.py --json docs/serving_copy_cpu.jsonl
    python benchmarks/bench_serving_copy.py --from-json docs/serving_copy_cpu.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("off", "on", "checksums", "snapshot", "fp8", "delta")
OPTIONS = {"off": {"serve_copies": False}, "on": {}, "checksums": {"checksums": True}, "snapshot": {"snapshot": True},
           "fp8": {"quantization": "fp8"}, "delta": {"delta": True}}


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _extra(pub) -> int:
    """Bytes of the buffers a Publisher allocated besides the live parameters."""
    if not getattr(pub, "publishers", [pub]):
        return 0
    pubs = getattr(pub, "publishers", [pub])
    total = 0
    for p in pubs:
        bases = {}
        for t in [*p.snapshot.values(), *[x for pair in p.fp8.values() for x in pair]]:
            b = t._base if t._base is not None else t
            bases[b.data_ptr()] = b.numel() * b.element_size()
        total += sum(bases.values())
        total += 0 if p.checksums is None else p.checksums[0].numel() * 8
        total += 0 if p.delta is None else p.delta.nbytes
    return total


def _trainer(port: int, cfg: dict, args: dict):
    """(ddp, optimizer, step function) of the bf16 GPT at tp=2 under Megatron DDP + DistributedOptimizer."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf, optimizer_on_cpu

    model = build_gpt_model(dataclasses.replace(gpt_arch_from_hf(cfg, tp=2), dtype="bfloat16"), seed=0)
    model.config.bf16 = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    with optimizer_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True,
                                                     weight_decay=0.0, clip_grad=0.0), [ddp])
    model.train()
    seq, batch = args["seq"], args["batch"]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    position = torch.arange(seq)[None].expand(batch, seq)
    g = torch.Generator().manual_seed(0)

    def step(pub, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens[:, :-1], position, attention_mask=mask, labels=tokens[:, 1:]).float().mean().backward()
        with optimizer_on_cpu():
            ddp.finish_grad_sync()
        cm = pub.updating(version)
        t1 = time.perf_counter()
        cm.__enter__()
        t2 = time.perf_counter()
        with optimizer_on_cpu():
            opt.step()
        t3 = time.perf_counter()
        cm.__exit__(None, None, None)
        t4 = time.perf_counter()
        return {"step_s": t4 - t0, "opt_s": t3 - t2, "enter_s": t2 - t1, "exit_s": t4 - t3}

    return ddp, step


def _one(ddp, step, cfg: dict, rdzv, name: str, version: int, args: dict) -> tuple[dict, int]:
    from megarefit.online.trainer.publisher import Publisher

    gc.collect()
    torch.distributed.barrier()
    before = _status()["VmRSS"]
    peak_ok = _reset_peak()
    t0 = time.perf_counter()
    pub = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name=f"copycost-{name}-{torch.distributed.get_rank()}",
                                  **OPTIONS[name])
    setup = time.perf_counter() - t0
    after = _status()
    pubs = getattr(pub, "publishers", [pub])
    row = {"config": name, "serving": pub.serving, "rank": [tuple(p.rank) for p in pubs], "setup_s": setup,
           "rss_delta": after["VmRSS"] - before, "peak_delta": after["VmHWM"] - before if peak_ok else None,
           "registered": sum(p.agent.counters["registered_bytes"] for p in pubs), "extra": _extra(pub),
           "params_bytes": sum(t.numel() * t.element_size() for p in pubs for t in p.params.values()), "steps": []}
    for _ in range(args["warmup"] + args["steps"]):
        version += 1
        row["steps"].append(step(pub, version))
    row["steps"] = row["steps"][args["warmup"]:]
    del pub, pubs
    gc.collect()
    torch.distributed.barrier()
    row["rss_after_release"] = _status()["VmRSS"] - before
    return row, version


def worker(rank: int, world: int, port: int, rdzv_port: int, job: str, cfg: dict, args: dict) -> dict:
    from megatron.core import parallel_state as ps

    from megarefit.demo.megatron_cpu import init_parallel
    from megarefit.online.store.rendezvous import Rendezvous

    init_parallel(rank=rank, world_size=world, master_port=port, tp=2, pp=1)
    ddp, step = _trainer(port, cfg, args)
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    rows, version = [], 0
    for name in args["configs"]:
        row, version = _one(ddp, step, cfg, rdzv, name, version, args)
        rows.append(row)
    return {"rank": rank, "copy": ps.get_data_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(), "rows": rows}


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"


def table(records: list[dict]) -> str:
    mb = 1e6
    lines = [("| date | model per rank | config | serves | setup | RSS after setup (peak) | NIXL registered | "
             "extra buffers | `updating()` per step, ms | training step, ms | `optimizer.step()`, ms | "
             "`updating()` / step |"),
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in records:
        for row in rec["rows"]:
            over = [s["enter_s"] + s["exit_s"] for s in row["steps"]]
            steps = [s["step_s"] for s in row["steps"]]
            peak = "" if row["peak_delta"] is None else f" ({row['peak_delta'] / mb:+.1f})"
            lines.append(
                f"| {rec['date']} | {rec['params_bytes'] / mb:.1f} MB bf16 | {row['config']} | "
                f"{'yes' if row['serving'] else 'no'} | {row['setup_s'] * 1e3:.0f} ms | {row['rss_delta'] / mb:+.1f} MB"
                f"{peak} | {row['registered'] / mb:.1f} MB | {row['extra'] / mb:.1f} MB | {_ms(over)} | "
                f"{_ms(steps)} | {_ms([s['opt_s'] for s in row['steps']])} | "
                f"{statistics.median(over) / statistics.median(steps) * 100:.2f}% |")
    rec = records[-1]
    lines += ["", (f"Machine: {rec['machine']}; megatron-core {rec['megatron']}, nixl {rec['nixl']}. Copy-1 rank "
              f"(tp 0) of dp2 x tp2, 4 gloo processes on this machine; {rec['hidden']} hidden, {rec['layers']} layers, "
              f"vocab {rec['vocab']}, batch {rec['batch']} x {rec['seq']} tokens; median (min-max) of {rec['steps']} "
              f"steps after {rec['warmup']} warm-up. RSS in MB of 10^6 bytes.")]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--mmap-threshold", type=int, default=131072, help="MALLOC_MMAP_THRESHOLD_ of the workers")
    ap.add_argument("--json", help="append the record to this JSON-lines file")
    ap.add_argument("--from-json", help="print the table of a recorded file and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.from_json:
        print(table([json.loads(line) for line in Path(ns.from_json).read_text().splitlines() if line.strip()]))
        return 0
    from importlib.metadata import version

    from megarefit.demo.bench import bench_config, machine
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    cfg = bench_config(ROOT / "tests" / "data" / "configs" / "Qwen3-0.6B.json", ns.layers)
    cfg.update({"hidden_size": ns.hidden, "intermediate_size": ns.ffn, "vocab_size": ns.vocab, "head_dim": 64,
                "num_attention_heads": ns.hidden // 64, "num_key_value_heads": max(2, ns.hidden // 128),
                "max_position_embeddings": 256})
    ensure_job_secret()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(ns.mmap_threshold)  # the spawned workers' allocator
    os.environ.setdefault("MEGAREFIT_NIXL_PROGRESS_DELAY_US", "1000")  # as the test suite: idle agents do not spin
    job = "copy-cost"
    rdzv = Rendezvous.serve(job=job)
    args = {k: getattr(ns, k) for k in ("seq", "batch", "steps", "warmup", "configs")}
    t0 = time.perf_counter()
    results = start_workers(worker, world_size=4, args=(rdzv.port, job, cfg, args), start_method="spawn").join(timeout=900)
    mine = next(r for r in results if r["copy"] == 1 and r["tp"] == 0)
    rec = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "megatron": version("megatron-core"),
           "nixl": version("nixl"), "hidden": ns.hidden, "layers": ns.layers, "vocab": ns.vocab, "ffn": ns.ffn,
           "seq": ns.seq, "batch": ns.batch, "steps": ns.steps, "warmup": ns.warmup, "wall_s": time.perf_counter() - t0,
           "params_bytes": next(r["params_bytes"] for r in mine["rows"] if r["config"] != "off"),
           "rows": mine["rows"], "other_copy1_rows": next(r for r in results if r["copy"] == 1 and r["tp"] == 1)["rows"]}
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    print(table([rec]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
