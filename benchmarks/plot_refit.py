"""Plot warm refit GB/s per layout against raw NIXL and NCCL broadcast of the same bytes.

    python benchmarks/plot_refit.py docs/refit_gpu.jsonl docs/refit_gpu.png

Input: the JSON lines ``benchmarks/run_refit_gpu.sh`` writes (one per case, from
``bench_nixl.py --json``). Needs matplotlib (``pip install 'megarefit[bench]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("png")
    ns = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(ns.jsonl).read_text().splitlines() if line.strip()]
    labels = [r["label"] or f"{r['config']} tp{r['tp']}" for r in rows]
    series = {"megarefit warm refit (whole cycle)": [r["bytes"] / r["warm_best"] / 1e9 for r in rows],
              "raw NIXL READ, one descriptor per trainer": [r["bytes"] / r["raw_best"] / 1e9 for r in rows],
              "NCCL broadcast, 1 GiB buckets": [r["bytes"] / r["nccl_best"] / 1e9 if r.get("nccl_best") else 0
                                                for r in rows]}
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.27
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=name)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (bytes the receiver places / seconds)")
    ax.set_title("Warm refit, trainer processes on GPU 0 -> receiver process on GPU 1 (2x H200, NVLink, CUDA IPC)")
    ax.legend(fontsize=8, loc="lower left", framealpha=0.95)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(ns.png, dpi=110)
    print(f"wrote {ns.png}")


if __name__ == "__main__":
    main()
