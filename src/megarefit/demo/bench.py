"""``megarefit bench``: how fast a warm refit translates on this machine, against a plain copy.

Random Megatron shards with the planned shapes are put on ``device``; a warm
``run_refit_cycle`` into preallocated buffers (plan cached, views compiled,
nothing allocated) is timed against ONE contiguous ``copy_`` of the same byte count
between two preallocated buffers on the same device -- the floor for moving those
bytes once. Both are measured in the same run, ``repeat`` warm calls each.

:func:`bench_install` times what a consumer sees: a **staged** install (the whole share
pulled into an arena, then every tensor copied into the consumer's preallocated "model",
as vLLM's ``load_weights`` copies into its parameters) or a **streamed** one (the plan cut
into groups of whole layers, :func:`~megarefit.online.receiver.stream.stream_groups`, each pulled
into one ring buffer and copied into the model before the next group lands), and the
memory each holds above the model.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from megarefit.layout import SourceLayout
from megarefit.layout.dims import ModelDims, load_hf_config
from megarefit.plan import Plan
from megarefit.transport.execute import run_refit_cycle, torch_dtype
from megarefit.transport.local import LocalTransport

if TYPE_CHECKING:
    from megarefit.online.receiver.stream import StreamGroup


def sync(device: str | torch.device = "cuda") -> None:
    """Wait for ``device``'s work (``"cuda"``: the current device's); no-op off a GPU."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def time_each(fn: Callable[[], Any], repeat: int, device: str | torch.device = "cuda") -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn``, in order, synchronising ``device``
    before and after each (wall clock: ``time.perf_counter``)."""
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def append_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to the results file ``path``, one JSON object per line."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of the results file ``path`` (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def best_of(fn: Callable[[], Any], repeat: int, device: str | torch.device = "cuda") -> tuple[float, float]:
    """(best, median) seconds of ``repeat`` calls, synchronising the GPU around each."""
    times = time_each(fn, repeat, device)
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
    """Warm timings of :func:`bench_refit`, seconds per call, one entry per timed call.

    ``copy_times``: ONE contiguous ``copy_`` of ``bytes`` bytes between two preallocated
    buffers on the same device (the strict baseline). ``refit_times``: a warm
    ``run_refit_cycle`` into preallocated buffers. ``copy_s`` / ``refit_s``: (best, median)."""

    bytes: int
    ops: int
    copy_times: list[float]
    refit_times: list[float]

    @property
    def copy_s(self) -> tuple[float, float]:
        return min(self.copy_times), statistics.median(self.copy_times)

    @property
    def refit_s(self) -> tuple[float, float]:
        return min(self.refit_times), statistics.median(self.refit_times)

    @property
    def ratio(self) -> float:
        """Median contiguous-copy time over median refit time (1.0: as fast as one copy)."""
        return self.copy_s[1] / self.refit_s[1]


def bench_refit(plan: Plan, *, device: str = "cpu", repeat: int = 5, shards: dict | None = None) -> BenchResult:
    """Time ``repeat`` warm refits of ``plan`` (after one cold one) against ``repeat`` single
    contiguous copies of the same byte count (``plan.nbytes``) on ``device``, in the same run;
    ``shards``: the sources (:func:`random_shards`, made here when not given)."""
    dtype = getattr(torch, plan.dtype)
    shards = random_shards(plan, device, dtype) if shards is None else shards
    src = torch.ones(plan.nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    transport = LocalTransport(shards)
    buffers = {ref.name: torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
               for ref, meta in plan.targets.items()}

    def refit() -> None:
        for _ in run_refit_cycle(plan, transport, buffers=buffers):
            pass

    refit()  # cold: compiles the views
    dst.copy_(src)  # cold: first touch of the destination
    return BenchResult(plan.nbytes, len(plan.ops), time_each(lambda: dst.copy_(src), repeat, device),
                       time_each(refit, repeat, device))


@dataclass
class InstallResult:
    """Warm cycles of one install mode (:func:`bench_install`).

    ``seconds``: (best, median) of the warm cycles, the pulls and the consumer's copies
    together. ``extra_bytes``: what the receiver side holds above the consumer's model, in
    bytes: the arena (staged) or the ring (streamed). ``measured_extra_bytes``: on CUDA,
    ``torch.cuda.max_memory_allocated`` during the cycles (the arena or ring allocated in
    them) less what was allocated before (model and shards), in bytes; ``None`` off a GPU.
    ``model``: the consumer's tensors after the last cycle, by name."""

    install: str
    groups: int
    seconds: tuple[float, float]
    extra_bytes: int
    measured_extra_bytes: int | None
    model: dict[str, torch.Tensor] = field(repr=False)


def consumer_model(plan: Plan, device: str) -> dict[str, torch.Tensor]:
    """The consumer's preallocated tensors (like vLLM's parameters), by target name: every
    target handed over (not the FP8 ``staging`` ones), uninitialised."""
    return {ref.name: torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=device)
            for ref, meta in plan.targets.items() if ref not in plan.staging}


def plan_stream(plan: Plan, memory_budget: int | Literal["auto"]) -> tuple[int, list[StreamGroup]]:
    """``(budget, groups)`` of a streamed install of ``plan`` within ``memory_budget`` bytes
    (``"auto"``: :func:`~megarefit.online.receiver.stream.default_memory_budget`). In-process, the
    :class:`LocalTransport` needs no NIXL scratch, so the ring gets the whole budget.

    Raises:
        MemoryBudgetError: a layer (or the embedding / head) needs more than the budget; the
            message names it and the bytes it needs.
    """
    from megarefit.online.receiver.stream import MemoryBudgetError, default_memory_budget, stream_groups

    budget = default_memory_budget(plan) if memory_budget == "auto" else int(memory_budget)
    try:
        return budget, stream_groups(plan, budget)
    except MemoryBudgetError as exc:
        raise MemoryBudgetError(f"{exc}: a memory budget of {budget} bytes is too small; {exc.ring_bytes_needed} "
                                "bytes or more fit (the local transport needs no scratch: the ring is the whole "
                                "budget)", exc.ring_bytes_needed) from None


def _staged_cycle(plan: Plan, shards: dict, model: dict[str, torch.Tensor], device: str
                  ) -> tuple[Callable[[], None], int]:
    """One staged install (every target pulled into its arena buffer, then copied into
    ``model``) and the arena's bytes."""
    transport = LocalTransport(shards)
    arena = {ref.name: torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=device)
             for ref, meta in plan.targets.items()}

    def cycle() -> None:
        for name, tensor in run_refit_cycle(plan, transport, buffers=arena):  # FP8 staging is not handed over
            model[name].copy_(tensor)

    return cycle, sum(t.numel() * t.element_size() for t in arena.values())


def _streamed_cycle(groups: list[StreamGroup], shards: dict, model: dict[str, torch.Tensor], device: str
                    ) -> tuple[Callable[[], None], int]:
    """One streamed install (each group pulled into the ring, then copied into ``model``
    before the next group) and the ring's bytes (up to the last byte a group uses, as
    :class:`~megarefit.online.RefitReceiver` allocates it). ``run_refit_cycle`` zeroes each
    ring view's ``zero_fill`` boxes (vLLM vocab padding) before every pull: the ring held
    other groups' bytes. One :class:`LocalTransport` per group, so each keeps its compiled
    copies across cycles (one holds one layout), as NIXL keeps each group's prepared READs."""
    ring = torch.empty(max(g.start + g.nbytes for g in groups), dtype=torch.uint8, device=device)
    steps = [(g.plan, LocalTransport(shards), {ref.name: v for ref, v in g.views(ring).items()}) for g in groups]
    cuda = torch.device(device).type == "cuda"

    def cycle() -> None:
        for plan, transport, views in steps:
            if cuda:  # the consumer's copies out of the ring are queued, not done: wait before reusing it
                torch.cuda.synchronize(device)
            for name, tensor in run_refit_cycle(plan, transport, buffers=views):
                model[name].copy_(tensor)

    return cycle, ring.numel()


def bench_install(plan: Plan, shards: dict, *, groups: list[StreamGroup] | None = None, device: str = "cpu",
                  repeat: int = 5) -> InstallResult:
    """Time ``repeat`` warm installs of ``plan`` from ``shards`` (``{rank: {name: tensor}}``,
    :func:`random_shards`) into a fresh consumer model on ``device``, after one cold cycle:
    staged, or streamed through ``groups`` (:func:`plan_stream`). On CUDA the peak memory
    above what was allocated before the arena / ring is measured (:class:`InstallResult`)."""
    model = consumer_model(plan, device)
    cuda, base = torch.device(device).type == "cuda", 0
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    if groups is None:
        cycle, extra = _staged_cycle(plan, shards, model, device)
    else:
        cycle, extra = _streamed_cycle(groups, shards, model, device)
    cycle()  # cold: compiles the views
    seconds = best_of(cycle, repeat, device)
    measured = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return InstallResult("staged" if groups is None else "streamed", 1 if groups is None else len(groups),
                         seconds, extra, measured, model)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two models hold the same names, shapes, dtypes and bytes."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(
        x.shape == b[k].shape and x.dtype == b[k].dtype and torch.equal(raw(x), raw(b[k])) for k, x in a.items())


def layout_for(config: Any, *, tp: int, ep: int = 1, layers: int = 0) -> tuple[ModelDims, SourceLayout]:
    cfg = dict(load_hf_config(config))
    if layers:
        cfg["num_hidden_layers"] = layers
    dims = ModelDims.from_hf_config(cfg)
    return dims, SourceLayout.build(tp=tp, pp=1, ep=ep, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers)


