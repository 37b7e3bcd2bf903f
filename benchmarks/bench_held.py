"""What checking the held arena costs a delta receiver (``megarefit.online.delta.held``): the
fingerprint taken when a version is fenced and taken again before the next delta, against one
device copy of the same bytes (the strict baseline: the cheapest pass over them).

Per arena size: median (min-max) seconds over ``--repeat`` runs of each, after one warm-up,
and the fingerprint's rate as a fraction of the copy's. A delta cycle pays two fingerprints
(the check, then the new version's); a full cycle one.

    python benchmarks/bench_held.py --device cpu --gib 0.0625 0.5 --json docs/held_cpu.jsonl
    python benchmarks/bench_held.py --device cuda:0 --gib 1 8 32 [--path pytorch] --json out.jsonl
    python benchmarks/bench_held.py --from-json docs/held_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megarefit.demo.bench import machine  # noqa: E402
from megarefit.online.delta import held_kernel  # noqa: E402
from megarefit.online.delta.held import fingerprint, weighted_sums  # noqa: E402


def _timed(fn, device: torch.device, repeat: int) -> list[float]:
    fn()  # warm: allocations, first touch
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def measure(device: torch.device, gib: float, repeat: int, path: str = "auto") -> dict:
    """One arena size: fingerprint and copy seconds, bf16 arena of ``gib`` GiB on ``device``;
    ``path`` ``"pytorch"`` times the PyTorch path even where the fused kernel passed its check."""
    numel = int(gib * 2 ** 30) // 2
    arena = torch.randn(numel, device=device).to(torch.bfloat16)
    other = torch.empty_like(arena)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    fused = held_kernel.usable(device, weighted_sums) and path == "auto"
    fp = _timed(lambda: fingerprint(arena, fused=fused), device, repeat)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    copy = _timed(lambda: other.copy_(arena), device, repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"date": date.today().isoformat(), "device": name, "machine": machine(),
            "versions": {"torch": torch.__version__, "triton": _triton()}, "threads": torch.get_num_threads(),
            "bytes": numel * 2, "repeat": repeat, "fingerprint_s": fp, "copy_s": copy,
            "fingerprint_peak_extra_bytes": peak, "path": "fused" if fused else "pytorch"}


def summary(rows: list[dict]) -> str:
    lines = ["| device | fingerprint path | arena | fingerprint | one copy | fingerprint rate / copy rate |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        fp, cp = statistics.median(r["fingerprint_s"]), statistics.median(r["copy_s"])
        path = {"fused": "one Triton launch", "pytorch": "PyTorch ops"}[r.get("path", "pytorch")]
        lines.append(f"| {r['device']} ({r['threads']} threads) | {path} | {r['bytes'] / 2 ** 30:.3g} GiB "
                     f"| {fp * 1e3:.1f} ms ({min(r['fingerprint_s']) * 1e3:.1f}-{max(r['fingerprint_s']) * 1e3:.1f}) "
                     f"| {cp * 1e3:.1f} ms ({min(r['copy_s']) * 1e3:.1f}-{max(r['copy_s']) * 1e3:.1f}) "
                     f"| {cp / fp:.2f}x |")
    n = {r["repeat"] for r in rows}
    lines.append("")
    for m in sorted({r["machine"] for r in rows if "machine" in r}):
        lines.append(f"Machine: {m}; triton {rows[0]['versions']['triton']}.")
    lines.append(f"Median (min-max) of {'/'.join(map(str, sorted(n)))} runs each, recorded {rows[0]['date']}. "
                 "A copy reads and writes each byte, the fingerprint only reads it.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gib", type=float, nargs="+", default=[0.0625, 0.5])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--path", choices=("auto", "pytorch"), default="auto",
                    help="pytorch: time the PyTorch path even where the fused kernel is used")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path)
    ns = ap.parse_args()
    if ns.from_json:
        rows = [json.loads(line) for line in ns.from_json.read_text().splitlines() if line.strip()]
        print(summary(rows))
        return 0
    rows = [measure(torch.device(ns.device), g, ns.repeat, ns.path) for g in ns.gib]
    if ns.json:
        with ns.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
