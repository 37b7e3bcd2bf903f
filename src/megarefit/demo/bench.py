"""``megarefit bench``: how fast a warm refit translates on this machine, against a plain copy.

Random Megatron shards with the planned shapes are put on ``device``; a warm
``run_refit_cycle`` into preallocated buffers (plan cached, views compiled,
nothing allocated) is timed against ``copy_`` of every source shard the plan
reads into preallocated tensors of the same sizes -- the floor for moving those
bytes once. Both are measured in the same run; best of ``repeat``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarefit.layout import SourceLayout
from megarefit.layout.dims import ModelDims, load_hf_config
from megarefit.plan import Plan
from megarefit.transport.execute import run_refit_cycle
from megarefit.transport.local import LocalTransport


def sync(device: str | torch.device = "cuda") -> None:
    """Wait for ``device``'s work (``"cuda"``: the current device's); no-op off a GPU."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def best_of(fn: Callable[[], Any], repeat: int, device: str | torch.device = "cuda") -> tuple[float, float]:
    """(best, median) seconds of ``repeat`` calls, synchronising the GPU around each."""
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def bench_config(path: str | Path, layers: int = 0) -> dict:
    """A benchmark's HF config: ``path`` as JSON, its ``quantization_config`` dropped (the
    benchmark chooses), shrunk to ``layers`` decoder layers when given (every layer then a
    MoE layer where the family has MoE: ``mlp_only_layers`` dropped)."""
    import json

    cfg = json.loads(Path(path).read_text())
    cfg.pop("quantization_config", None)
    if layers:
        cfg["num_hidden_layers"] = layers
        cfg.pop("mlp_only_layers", None)
    return cfg


def machine() -> str:
    """CPU model, cores, torch version and threads, Python version (and the GPU, if any)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}{gpu}")


def random_shards(plan: Plan, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random tensors for every source of ``plan`` (its local shapes), keyed ``{rank: {name: tensor}}``."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for ref, meta in plan.sources.items():
        out.setdefault(ref.rank, {})[ref.name] = torch.randn(meta.shape, generator=g).to(device, dtype)
    return out


def time_cold_plan(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                   repeat: int = 3) -> tuple[Plan, list[float]]:
    """Plan ``repeat`` times with the plan cache cleared (validation included); the plan and
    the seconds of each."""
    from megarefit.planner import plan_megatron_to_hf

    times = []
    for _ in range(repeat):
        plan_megatron_to_hf.cache_clear()
        t0 = time.perf_counter()
        plan = plan_megatron_to_hf(dims, layout, dtype)
        times.append(time.perf_counter() - t0)
    return plan, times


@dataclass
class BenchResult:
    bytes: int
    ops: int
    copy_s: tuple[float, float]
    refit_s: tuple[float, float]

    @property
    def ratio(self) -> float:
        return self.copy_s[0] / self.refit_s[0]


def bench_refit(plan: Plan, *, device: str = "cpu", repeat: int = 5) -> BenchResult:
    """Time a warm refit of ``plan`` against a plain copy of the bytes it reads (same run)."""
    dtype = getattr(torch, plan.dtype)
    shards = random_shards(plan, device, dtype)
    read = {op.src for op in plan.ops}
    src = [shards[r.rank][r.name] for r in plan.sources if r in read]
    dst = [torch.empty_like(t) for t in src]
    transport = LocalTransport(shards)
    buffers = {ref.name: torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
               for ref, meta in plan.targets.items()}

    def plain_copy() -> None:
        for s, d in zip(src, dst):
            d.copy_(s)

    def refit() -> None:
        for _ in run_refit_cycle(plan, transport, buffers=buffers):
            pass

    refit()  # cold: compiles the views
    return BenchResult(plan.nbytes, len(plan.ops), best_of(plain_copy, repeat, device), best_of(refit, repeat, device))


def layout_for(config: Any, *, tp: int, ep: int = 1, layers: int = 0) -> tuple[ModelDims, SourceLayout]:
    cfg = dict(load_hf_config(config))
    if layers:
        cfg["num_hidden_layers"] = layers
    dims = ModelDims.from_hf_config(cfg)
    return dims, SourceLayout.build(tp=tp, pp=1, ep=ep, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers)


