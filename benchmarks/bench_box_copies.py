"""Strided box copies on one GPU: the row-parallel pieces of a refit into full tensors.

A tp=T trainer's ``linear_proj`` / ``linear_fc2`` shard ``[rows, cols/T]`` lands in columns
``[t*cols/T, (t+1)*cols/T)`` of the full ``o_proj`` / ``down_proj``: a 2-D box, contiguous on the
source, strided on the destination. Run on a GPU machine from the repo root:

    python benchmarks/bench_box_copies.py [--config tests/data/configs/Qwen3-8B.json] [--tp 2] [--layers 36]

Times (CUDA events, every one of ``--repeat`` warm calls; median (min-max) shown) for the same
bytes: one contiguous ``copy_``; the boxes
through :class:`~megarefit.transport.boxcopy.BoxCopies` (one batched Triton launch); one
``copy_`` per box (PyTorch's strided copy kernel); and, where CuPy is installed,
``cudaMemcpy2DAsync`` per box (the copy engines' strided path). ``--from-json FILE`` prints
the recorded tables.
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


def _time(fn, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` warm calls (CUDA events, after one cold call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def table(r: dict) -> str:
    """One run's heading and markdown table (as printed, and as docs/benchmarks.md shows it):
    median (min-max) where the record has every call's time (``samples``), else the best
    (older records)."""
    if "samples" in r:
        med = {k: statistics.median(v) for k, v in r["samples"].items()}
        base = med["plain contiguous copy_"]
        head = (f"median (min-max) of {len(r['samples']['plain contiguous copy_'])} warm calls, {r.get('date', '')}; "
                "ratio: median over median")
        lines = [f"machine: {r['machine']}", (f"{r['config']}, {r['layers']} layers, tp={r['tp']}: {r['boxes']} "
                 f"row-parallel boxes, {r['bytes'] / 1e9:.3f} GB; {head}"), "",
                 "| path | ms | GB/s (median) | vs one contiguous copy |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {m * 1e3:.2f} ({min(r['samples'][k]) * 1e3:.2f}-{max(r['samples'][k]) * 1e3:.2f}) | "
                  f"{r['bytes'] / m / 1e9:.0f} | {base / m:.2f}x |" for k, m in med.items()]
        return "\n".join(lines)
    base = r["seconds"]["plain contiguous copy_"]
    lines = [f"machine: {r['machine']}", (f"{r['config']}, {r['layers']} layers, tp={r['tp']}: {r['boxes']} row-parallel "
             f"boxes, {r['bytes'] / 1e9:.3f} GB; best of the warm calls (no per-call times recorded)"), "",
             "| path | s | GB/s | vs contiguous |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {s:.5f} | {r['bytes'] / s / 1e9:.0f} | {base / s:.2f}x |" for name, s in r["seconds"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megarefit.demo.bench import machine
    from megarefit.transport.boxcopy import BoxCopies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "tests/data/configs/Qwen3-8B.json"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="append the result as one JSON line")
    ap.add_argument("--from-json", help="print the tables of recorded results (a --json file) and exit")
    ns = ap.parse_args(argv)
    if ns.from_json:
        lines = Path(ns.from_json).read_text(encoding="utf-8").splitlines()
        print("\n\n".join(table(json.loads(line)) for line in lines if line.strip()))
        return 0
    cfg = json.loads(Path(ns.config).read_text(encoding="utf-8"))
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * (cfg.get("head_dim") or hidden // cfg["num_attention_heads"])
    shapes = [(hidden, q), (hidden, ffn)] * ns.layers  # o_proj, down_proj: [rows, cols]
    dev = torch.device("cuda")
    pairs = []
    for rows, cols in shapes:
        full = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)
        for t in range(ns.tp):
            shard = torch.randn(rows, cols // ns.tp, dtype=torch.bfloat16, device=dev)
            pairs.append((full[:, t * cols // ns.tp:(t + 1) * cols // ns.tp], shard))
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    boxes = BoxCopies(pairs)
    rows = {"plain contiguous copy_": _time(lambda: dst.copy_(src), ns.repeat),
            "BoxCopies (one batched launch)": _time(boxes, ns.repeat),
            "copy_ per box (PyTorch strided kernel)": _time(lambda: [d.copy_(s) for d, s in pairs], ns.repeat)}
    try:
        import cupy

        stream = torch.cuda.current_stream().cuda_stream

        def memcpy2d() -> None:
            for d, s in pairs:
                item = d.element_size()
                cupy.cuda.runtime.memcpy2DAsync(d.data_ptr(), d.stride(0) * item, s.data_ptr(), s.stride(0) * item,
                                                d.shape[1] * item, d.shape[0], 3, stream)

        rows["cudaMemcpy2DAsync per box (CuPy)"] = _time(memcpy2d, ns.repeat)
    except ImportError:
        pass
    for d, s in pairs:  # every path wrote the same boxes: check the last one's result
        assert torch.equal(d, s)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "config": Path(ns.config).stem, "tp": ns.tp,
              "layers": ns.layers, "boxes": len(pairs), "bytes": nbytes,
              "seconds": {k: statistics.median(v) for k, v in rows.items()}, "samples": rows}
    print(table(result))
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
