"""``megarefit plan --dp``: the bytes each trainer GPU serves to whole vLLM engines.

Every worker of the engine is planned (``--vllm-tp`` x ``--vllm-dp`` workers; without
``--vllm-tp`` one receiver of full HF tensors per replica), each picks its holders as a
receiver would (:func:`~megarefit.planner.holders.served_by_readers`, reader ``replica +
replicas * worker``), and the bytes are summed per trainer GPU: every data-parallel copy
serves (``--dp``), ``--replicas`` engines read. Units: bytes in the JSON, MB / GB printed.
"""

from __future__ import annotations

import json
from typing import Any

from rich.table import Table


def engine_targets(target: Any) -> list[Any]:
    """Every worker of ``target``'s engine (``[None]``: one HF receiver)."""
    if target is None:
        return [None]
    from dataclasses import replace

    return [replace(target, rank=w % target.tp, dp_rank=w // target.tp) for w in range(target.tp * target.dp)]


def served(dims: Any, layout: Any, dtype: str, target: Any, fmt: Any, replicas: int) -> dict[Any, int]:
    """``{trainer rank: bytes}`` served to ``replicas`` engines like ``target``'s, every worker's
    plan summed, holders chosen (ranks that serve nothing left out)."""
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.planner.holders import Reader, served_by_readers
    from megarefit.quant.planning import plan_fp8
    from megarefit.targets import plan_megatron_to_vllm

    workers = engine_targets(target)
    out: dict[Any, int] = {}
    for w, worker in enumerate(workers):
        if worker is None:
            plan = plan_megatron_to_hf(dims, layout, dtype)
            plan = plan if fmt is None else plan_fp8(plan, fmt)
        else:
            plan = plan_megatron_to_vllm(dims, layout, dtype, worker, fmt)
        readers = [Reader.of(r, replicas, w, len(workers)) for r in range(replicas)]
        for rank, b in served_by_readers(plan, readers).items():
            out[rank] = out.get(rank, 0) + b
    return out


def summary(per_rank: dict[Any, int], layout: Any, replicas: int, workers: int) -> dict[str, Any]:
    """The JSON ``--served-json`` writes: per trainer GPU bytes, and busiest over the mean (the
    mean over every trainer GPU of the layout, idle ones included)."""
    gpus = layout.tp * layout.dp * layout.pp
    total = sum(per_rank.values())
    return {"layout": layout.to_dict(), "trainer_gpus": gpus, "replicas": replicas, "workers_per_engine": workers,
            "bytes": total, "busiest": max(per_rank.values(), default=0), "mean": total / gpus,
            "serving": len(per_rank),
            "per_rank": [{"tp": r.tp, "pp": r.pp, "ep": r.ep, "copy": r.copy, "bytes": b}
                         for r, b in sorted(per_rank.items())]}


def served_table(s: dict[str, Any], rows: int = 16) -> Table:
    """The busiest ``rows`` trainer GPUs, then the spread."""
    table = Table(title=f"bytes each trainer GPU serves to {s['replicas']} engine(s) of {s['workers_per_engine']} "
                        "worker(s), every worker's plan summed")
    for col in ("tp", "pp", "ep", "copy", "serves", "of the mean"):
        table.add_column(col, justify="right")
    top = sorted(s["per_rank"], key=lambda r: -r["bytes"])[:rows]
    for r in top:
        table.add_row(str(r["tp"]), str(r["pp"]), str(r["ep"]), str(r["copy"]), f"{r['bytes'] / 1e6:,.1f} MB",
                      f"{r['bytes'] / s['mean']:.3f}x" if s["mean"] else "-")
    return table


def served_line(s: dict[str, Any]) -> str:
    return (f"{s['serving']} of {s['trainer_gpus']} trainer GPUs serve {s['bytes'] / 1e9:,.2f} GB in all; the busiest "
            f"{s['busiest'] / 1e9:,.3f} GB, {s['busiest'] / s['mean']:.3f}x the mean")


def write(s: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(s, f, indent=1)


__all__ = ["engine_targets", "served", "served_line", "served_table", "summary", "write"]
