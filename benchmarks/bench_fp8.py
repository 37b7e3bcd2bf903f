"""Trainer-side block-FP8 quantization speed: one rank's shards, fused kernel vs a device copy.

    python benchmarks/bench_fp8.py [--config tests/data/configs/Qwen3-30B-A3B.json] [--layers 8]
        [--tp 2 --ep 2 --etp 1 --expert-layout te_grouped] [--device cuda]

Builds rank 0's shards with the planned shapes (random bf16), finds the ones its Publisher
would serve as FP8 (``plan_fp8``), and times, best of ``--repeat``:

* the fused quantizer (:class:`~megarefit.quant.kernel.Fp8Quantizer`: one launch for
  every 128x128 block of every shard, into preallocated FP8 + scale buffers);
* the torch path, tensor by tensor (what CPUs and UE8M0 scales use);
* a device copy of the same bf16 bytes into a preallocated buffer (the floor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from megarefit.demo.bench import bench_config, best_of, machine
    from megarefit.layout.dims import ModelDims
    from megarefit.layout import SourceLayout
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.layout.geometry import source_tensors
    from megarefit.quant import Fp8Format, quantize_fp8
    from megarefit.quant.kernel import Fp8Quantizer
    from megarefit.quant.planning import fp8_sources, plan_fp8

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-30B-A3B.json"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--expert-layout", default="te_grouped")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    cfg = bench_config(args.config, args.layers)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=args.tp, pp=1, ep=args.ep, etp=args.etp, padded_vocab_size=dims.padded_vocab_size(
        args.tp), num_layers=dims.num_layers, expert_layout=args.expert_layout)
    fmt = Fp8Format()
    plan = plan_fp8(plan_megatron_to_hf(dims, layout, "bfloat16"), fmt)
    rank = layout.ranks()[0]
    shapes = source_tensors(dims, layout)[rank]
    names = [ref.name for ref in fp8_sources(plan, rank)]
    g = torch.Generator(device=args.device).manual_seed(0)
    items = []
    for name in names:
        src = torch.randn(shapes[name].shape, generator=g, device=args.device, dtype=torch.bfloat16)
        items.append((src, torch.empty(src.shape, dtype=torch.float8_e4m3fn, device=args.device),
                      torch.empty(fmt.scale_shape(tuple(src.shape)), dtype=torch.float32, device=args.device)))
    nbytes = sum(s.numel() * s.element_size() for s, _, _ in items)
    fused = Fp8Quantizer(items, fmt)
    fused()
    loop = [quantize_fp8(s, fmt) for s, _, _ in items]  # warm-up + equality
    exact = all(torch.equal(o.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc, qs)
                for (_, o, sc), (q, qs) in zip(items, loop))
    flat_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
    flat_dst = torch.empty_like(flat_src)
    rows = {"fused quantizer (one launch)" if fused.fused else "quantizer (torch path)": best_of(fused, args.repeat,
                                                                                                   args.device)}
    if fused.fused:
        for warps, chunk in ((4, 32), (4, 128)):
            other = Fp8Quantizer(items, fmt, num_warps=warps, chunk=chunk)
            rows[f"fused quantizer, {warps} warps, {chunk}-row steps"] = best_of(other, args.repeat, args.device)
    rows |= {
            "torch path, tensor by tensor": best_of(lambda: [quantize_fp8(s, fmt, out=o, scale_out=c)
                                                             for s, o, c in items], max(2, args.repeat // 3),
                                                    args.device),
            "device copy of the same bf16 bytes": best_of(lambda: flat_dst.copy_(flat_src), args.repeat, args.device)}
    copy_s = rows["device copy of the same bf16 bytes"][0]
    print(f"machine: {machine()}")
    print(f"{Path(args.config).stem}, {dims.num_layers} layers, rank {tuple(rank)} of tp={args.tp} ep={args.ep} "
          f"etp={layout.etp} {layout.expert_layout}: {len(items)} FP8 shards, {nbytes / 1e9:.3f} GB bf16 in, "
          f"{sum(o.numel() for _, o, _ in items) / 1e9:.3f} GB FP8 out; fused == torch path bytes: {exact}")
    print("| path | best s | median s | GB/s (bf16 read) | vs device copy |")
    print("|---|---:|---:|---:|---:|")
    for name, (best, median) in rows.items():
        print(f"| {name} | {best:.4f} | {median:.4f} | {nbytes / best / 1e9:.1f} | {copy_s / best:.2f}x |")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"shards": len(items), "bf16_bytes": nbytes, "exact": exact,
                                **{k: v[0] for k, v in rows.items()}}) + "\n")


if __name__ == "__main__":
    main()
