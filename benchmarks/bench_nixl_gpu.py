"""NIXL refit with GPU memory on either side (run on a GPU machine; one process).

    python benchmarks/bench_nixl_gpu.py [--config tests/data/configs/Qwen3-0.6B.json] [--tp 2]

Publishers serve random shards from GPU (or host) memory, registered as NIXL VRAM (DRAM);
a ``RefitReceiver(device=...)`` pulls into GPU (or host) memory. For each of the four
combinations: the pulled tensors must equal ``megatron_to_hf`` of the same shards
(bit-exact), and a warm cycle is timed. On machines without CUDA IPC / GPUDirect, UCX
stages GPU memory through the host, so these numbers say nothing about NVLink / RDMA
bandwidth -- the point is that GPU-resident trainers and GPU receivers work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

import megarefit
from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver
from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret
from megarefit.online.trainer.publisher import Publisher
from megarefit.planner import plan_megatron_to_hf

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    dims = megarefit.ModelDims.from_hf_config(cfg)
    layout = megarefit.SourceLayout.build(tp=args.tp, pp=1, padded_vocab_size=dims.padded_vocab_size(args.tp),
                                          num_layers=dims.num_layers)
    plan = plan_megatron_to_hf(dims, layout, "bfloat16")
    g = torch.Generator().manual_seed(0)
    host = {}
    for ref, meta in plan.sources.items():
        host.setdefault(ref.rank, {})[ref.name] = torch.randn(meta.shape, generator=g).bfloat16()
    want = megarefit.megatron_to_hf(host, cfg, tp=args.tp)
    print(f"{Path(args.config).stem} tp={args.tp} bf16, {plan.nbytes / 1e9:.2f} GB; "
          f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    print("| trainer memory | receiver memory | bit-exact | warm cycle s | GB/s |")
    print("|---|---|---|---:|---:|")
    for i, (src_dev, dst_dev) in enumerate(itertools.product(("cuda", "cpu"), ("cuda:0", "cpu"))):
        shards = {r: {n: t.to(src_dev).contiguous() for n, t in s.items()} for r, s in host.items()}
        job = f"gpu-{i}"
        ensure_job_secret()  # the trainer processes started below inherit it
        rdzv = Rendezvous.serve(job=job)
        pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=args.tp, pp=1), rendezvous=rdzv,
                          agent_name=f"{job}-t{r[0]}")
                for r, s in shards.items()]
        receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=60, device=dst_dev)
        times = []
        for v in range(1, args.cycles + 1):
            for p in pubs:
                p.publish(v)
            t0 = time.perf_counter()
            got = dict(receiver.run_refit_cycle(v))
            if dst_dev != "cpu":
                torch.cuda.synchronize(dst_dev)
            times.append(time.perf_counter() - t0)
        exact = got.keys() == want.keys() and all(torch.equal(got[k].cpu(), w) for k, w in want.items())
        best = min(times[1:]) if len(times) > 1 else times[0]
        print(f"| {src_dev} | {dst_dev} | {exact} | {best:.4f} | {plan.nbytes / best / 1e9:.2f} |")


if __name__ == "__main__":
    main()
