"""NIXL refit vs a raw NIXL transfer of the same bytes; cold vs warm cycles.

Run from the repo root (CPU, UCX on loopback; ~1 min):

    python benchmarks/bench_nixl.py [--config tests/data/configs/Qwen3-0.6B.json] [--tp 2] [--cycles 5]

``tp`` trainer processes each serve random shards with the planned local shapes
through a real :class:`~megarefit.publisher.Publisher`, plus one extra registered
block of the same byte count. The receiver (this process) measures, in one run:

* ``refit cold``: the first ``RefitReceiver.run_refit_cycle`` (plan, allocate,
  register, prepare descriptors, pull);
* ``refit warm``: later cycles (plan cached, nothing registered, one prepared READ
  per trainer re-posted; includes the strided scratch copies of row-parallel slabs);
* ``raw NIXL``: one prepared READ per trainer of its whole block as one descriptor,
  the same bytes, warm;
* ``plain copy``: ``copy_`` of the same bytes within this process (memory bandwidth).
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def trainer(rank: int, world_size: int, _port: int, rdzv_port: int, cfg: dict, dtype: str) -> dict:
    from megarefit.dims import ModelDims
    from megarefit.layout import SourceLayout
    from megarefit.planner import source_tensors
    from megarefit.publisher import Publisher
    from megarefit.rendezvous import Rendezvous

    torch.set_num_threads(1)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=world_size, pp=1, padded_vocab_size=dims.padded_vocab_size(world_size),
                                num_layers=dims.num_layers)
    coord = (rank, 0, 0)
    g = torch.Generator().manual_seed(rank)
    params = {n: torch.randn(t.shape, generator=g).to(getattr(torch, dtype))
              for n, t in source_tensors(dims, layout)[coord].items()}
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job="bench")
    pub = Publisher(params, cfg, rank=coord, tp=world_size, pp=1, rendezvous=rdzv)
    raw = torch.empty(sum(p.numel() * p.element_size() for p in params.values()), dtype=torch.uint8)
    pub.agent.register([raw])
    rdzv.store.set(f"bench/raw/{rank}", f"{raw.data_ptr()},{raw.numel()}")
    rdzv.store.set(f"bench/meta/{rank}", pub.agent.metadata)  # now includes the raw block
    pub.publish(1)
    rdzv.wait_consumed(1, timeout=600)
    return {}


def main() -> None:
    from megarefit.bench import machine

    from megarefit.integrations.megatron import start_workers
    from megarefit.online import RefitReceiver
    from megarefit.rendezvous import Rendezvous

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-0.6B.json"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--receiver-threads", type=int, default=0, help="torch threads in the receiver (0: default)")
    args = ap.parse_args()
    if args.receiver_threads:
        torch.set_num_threads(args.receiver_threads)
    cfg = json.loads(Path(args.config).read_text())

    rdzv = Rendezvous.serve(job="bench")
    group = start_workers(trainer, world_size=args.tp, args=(rdzv.port, cfg, args.dtype))
    receiver = RefitReceiver(rdzv, name="bench-receiver", timeout=600)
    cycles = []
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        for _name, _tensor in receiver.run_refit_cycle(1):
            pass
        cycles.append((time.perf_counter() - t0, receiver.stats))
    stats = cycles[-1][1]

    # raw NIXL: each trainer's whole block, one descriptor each, prepared once, warm (own agent)
    from megarefit.transport.nixl import NixlAgent

    raw_agent = NixlAgent("bench-raw-receiver")
    agent = raw_agent.agent
    blocks = []
    for r in range(args.tp):
        addr, n = map(int, rdzv.store.get(f"bench/raw/{r}").decode().split(","))
        name = agent.add_remote_agent(rdzv.store.get(f"bench/meta/{r}"))
        blocks.append((name.decode() if isinstance(name, bytes) else name, addr, n))
    local = torch.empty(sum(n for *_, n in blocks), dtype=torch.uint8)
    raw_agent.register([local])
    handles, at = [], 0
    for name, addr, n in blocks:
        rh = agent.prep_xfer_dlist(name, [(addr, n, 0)], "DRAM")
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr() + at, n, 0)], "DRAM")
        handles.append(agent.make_prepped_xfer("READ", lh, [0], rh, [0]))
        at += n
    raw_times = []
    for _ in range(args.cycles + 1):
        t0 = time.perf_counter()
        for h in handles:
            agent.transfer(h)
        while any(agent.check_xfer_state(h) == "PROC" for h in handles):
            pass
        raw_times.append(time.perf_counter() - t0)
    raw_times = raw_times[1:]
    src, dst = torch.empty_like(local), torch.empty_like(local)
    src.fill_(1)
    copy_times = []
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
    rdzv.mark_consumed(1)
    group.join(timeout=120)

    nbytes = stats.bytes_moved
    warm = [t for t, s in cycles[1:]]
    pull = [s.seconds["pull"] for _, s in cycles[1:]]
    best_raw = min(raw_times)
    print(f"machine: {machine()}")
    print(f"receiver torch threads: {torch.get_num_threads()}")
    print(f"model: {Path(args.config).stem}, tp={args.tp} trainer processes, {args.dtype}; bytes moved "
          f"{nbytes / 1e9:.3f} GB = model bytes {stats.model_bytes / 1e9:.3f} GB "
          f"({nbytes / stats.model_bytes:.2f}x); raw block bytes {local.numel() / 1e9:.3f} GB")
    print("| path | best s | median s | GB/s (best) | vs raw NIXL |")
    print("|---|---:|---:|---:|---:|")
    rows = [("refit cold cycle (plan, alloc, register, prepare, pull)", [cycles[0][0]]),
            ("refit warm cycle (whole cycle)", warm), ("refit warm: pull stage only", pull),
            ("raw NIXL READ, same bytes, one block per trainer", raw_times),
            ("plain copy in one process, same bytes", copy_times)]
    for name, ts in rows:
        print(f"| {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {nbytes / min(ts) / 1e9:.2f} | "
              f"{best_raw / min(ts):.2f}x |")
    print("warm stage seconds:", {k: round(v, 4) for k, v in stats.seconds.items()})
    print("cold stage seconds:", {k: round(v, 4) for k, v in cycles[0][1].seconds.items()})
    print("counters after last cycle:", dict(receiver.counters))


if __name__ == "__main__":
    main()
