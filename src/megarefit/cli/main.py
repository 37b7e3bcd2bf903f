"""Command line: ``megarefit demo | plan | bench | name-map`` (``megarefit COMMAND --help`` for each)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import megarefit
from megarefit.errors import MegarefitError
from megarefit.specs.megatron_core import VERIFIED_VERSIONS, MegatronCore


def _mb(n: int) -> str:
    """Human-readable bytes (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _model_line(dims: Any, padded: int) -> str:
    return (f"{dims.family}: {dims.num_layers} layers, hidden {dims.hidden_size}, heads {dims.num_attention_heads} / "
            f"query groups {dims.num_query_groups}, head_dim {dims.head_dim}, ffn {dims.ffn_hidden_size}, "
            f"vocab {dims.vocab_size} (padded {padded}), tied={dims.tie_word_embeddings}")


def plan_table(plan: Any, *, per_rank: bool = False) -> Table:
    """Per pipeline stage (or per rank): ranks, ops, contiguous pulls, scratch copies, bytes per rank."""
    summary = plan.summary()["per_rank"]
    table = Table(title="plan per source rank" if per_rank else "plan per pipeline stage (values per rank)")
    cols = ("rank", "layers") if per_rank else ("pp stage", "ranks", "layers")
    for col in cols + ("ops", "contiguous", "scratch", "bytes"):
        table.add_column(col, justify="right", no_wrap=True)
    groups: dict[Any, list[dict[str, int]]] = defaultdict(list)
    for rank, row in sorted(summary.items(), key=lambda kv: (kv[0].pp, kv[0].tp, kv[0].ep)):
        groups[rank if per_rank else rank.pp].append(row)

    def span(values: list[int], fmt=str) -> str:
        lo, hi = min(values), max(values)
        return fmt(lo) if lo == hi else f"{fmt(lo)} - {fmt(hi)}"

    for key, rows in groups.items():
        stage = key.pp if per_rank else key
        head = (str(key),) if per_rank else (str(key), str(len(rows)))
        table.add_row(*head, str(plan.layout.stage_layers[stage]),
                      *(span([r[c] for r in rows]) for c in ("ops", "contiguous", "scratch")),
                      span([r["bytes"] for r in rows], _mb))
    total = plan.summary()["total"]
    head = ("total",) if per_rank else ("total", str(len(summary)))
    table.add_row(*head, str(plan.layout.num_layers), str(total["ops"]), str(total["contiguous"]),
                  str(total["scratch"]), _mb(total["bytes"]), style="bold")
    return table


def _layout(args: argparse.Namespace) -> tuple[Any, Any, Any, int]:
    """(HF config, dims, layout, padded vocab) from ``--config`` and the layout options."""
    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims, load_hf_config

    cfg = load_hf_config(args.config)
    dims = ModelDims.from_hf_config(cfg)
    args.etp = args.etp or dims.default_etp(args.tp)
    dims.check_layout(args.tp, args.pp, args.ep, args.etp)
    padded = dims.padded_vocab_size(args.tp, args.vocab_divisible_by)
    layout = SourceLayout.build(tp=args.tp, pp=args.pp, ep=args.ep, padded_vocab_size=padded,
                                num_layers=dims.num_layers, first_stage_layers=args.first_stage_layers,
                                last_stage_layers=args.last_stage_layers, layer_spec=args.layer_spec,
                                etp=args.etp, expert_layout=args.expert_layout, mtp_layers=args.mtp_layers,
                                megatron=MegatronCore.verified(args.megatron_version or _installed_megatron()),
                                dp=getattr(args, "dp", 0))
    return cfg, dims, layout, padded


def _installed_megatron() -> str:
    """The installed megatron-core's version (not imported).

    Raises:
        MegarefitError: none is installed (then ``--megatron-version`` must say which).
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        raise MegarefitError("megatron-core is not installed here: say which the trainer runs with "
                             f"--megatron-version (verified: {', '.join(VERIFIED_VERSIONS)})") from None


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.quant import resolve_quantization

    cfg, dims, layout, padded = _layout(args)
    target = _vllm_target(args)
    fmt = resolve_quantization(args.quantization, cfg)
    # planning runs whole-column ops of ~10^5-10^6 int64s: one thread is as fast, and a cold
    # process spends 0.2-0.5 s starting torch's intra-op pool on the first parallel sort
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if target is not None:
        from megarefit.targets import plan_megatron_to_vllm

        plan = plan_megatron_to_vllm(dims, layout, args.dtype, target)
        unquantized_bytes = plan.nbytes
        if fmt is not None:
            plan = plan_megatron_to_vllm(dims, layout, args.dtype, target, fmt)
    else:
        plan = plan_megatron_to_hf(dims, layout, args.dtype)
        unquantized_bytes = plan.nbytes
        if fmt is not None:
            from megarefit.quant.planning import plan_fp8

            plan = plan_fp8(plan, fmt)
    plan_s = time.perf_counter() - t0
    meta_s = None
    if args.execute_meta:
        meta_s = _execute_on_meta(plan)
    if args.format != "table":
        _print_rows(plan, args.format, plan_s)
        return 0
    _print_plan_header(console, args, dims, padded, layout, target)
    console.print(plan_table(plan, per_rank=args.per_rank))
    s = plan.summary()
    console.print(f"{s['sources']} Megatron tensors -> {s['targets']} {'vLLM' if target else 'HF'} tensors; "
                  f"{s['total']['ops']} ops ({s['total']['contiguous']} contiguous sliced pulls, "
                  f"{s['total']['scratch']} scratch copies), {_mb(plan.nbytes)}; validated exact cover.")
    if fmt is not None:
        from megarefit.quant.planning import fp8_weight_count

        console.print(_fp8_line(fp8_weight_count(plan), [q.reason for q in plan.quantize], fmt, plan.nbytes,
                                unquantized_bytes, args.dtype))
    if target is not None:
        console.print(_share_line(plan.nbytes, _whole_model_bytes(dims, layout, args.dtype, fmt)))
    timing = f"planned + validated in {plan_s:.3f} s"
    if meta_s is not None:
        timing += f"; executed on meta tensors in {meta_s:.3f} s"
    console.print(timing + f"; digest {plan.digest}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        console.print(f"plan written to {escape(args.json)}")
    if args.svg:
        _picture(args, plan, target, dims, layout, fmt)
        console.print(f"picture written to {escape(args.svg)}")
    return _print_served(args, console, dims, layout, target, fmt) if args.dp or args.served_json else 0


def _print_served(args: argparse.Namespace, console: Console, dims: Any, layout: Any, target: Any, fmt: Any) -> int:
    """``--dp``: what each trainer GPU serves to ``--replicas`` whole engines (cli/serving.py)."""
    from megarefit.cli import serving

    workers = len(serving.engine_targets(target))
    s = serving.summary(serving.served(dims, layout, args.dtype, target, fmt, args.replicas), layout, args.replicas,
                        workers)
    console.print(serving.served_table(s))
    console.print(serving.served_line(s))
    if args.served_json:
        serving.write(s, args.served_json)
        console.print(f"bytes per trainer GPU written to {escape(args.served_json)}")
    return 0


def _whole_model_bytes(dims: Any, layout: Any, dtype: str, fmt: Any) -> int:
    """Bytes of the whole model as full HF tensors in the refit's format: ``dtype``, or block FP8
    (weights + scales, the rest in ``dtype``) when ``fmt`` is an FP8 format."""
    from megarefit.planner import plan_megatron_to_hf

    full = plan_megatron_to_hf(dims, layout, dtype)
    if fmt is None:
        return full.nbytes
    from megarefit.quant.planning import plan_fp8

    return plan_fp8(full, fmt).nbytes


def _share_line(worker_bytes: int, model_bytes: int) -> str:
    """One worker's pull against the whole model, both in the same format (bytes)."""
    return (f"this worker pulls {_mb(worker_bytes)} of the model's {_mb(model_bytes)} in the same format "
            f"({100 * worker_bytes / model_bytes:.1f}%)")


def _print_plan_header(console: Console, args: argparse.Namespace, dims: Any, padded: int, layout: Any,
                       target: Any) -> None:
    """``megarefit plan``'s first lines: the model, the trainer layout and the vLLM worker (if any)."""
    console.print(_model_line(dims, padded))
    experts = (f", {dims.num_experts} experts (etp={layout.etp}, {layout.expert_layout})"
               if dims.num_experts else "")
    console.print(f"layout: tp={args.tp} pp={args.pp} ep={args.ep}{experts}, layers per stage "
                  f"{list(layout.stage_layers)}, layer spec {args.layer_spec}, dtype {args.dtype}, "
                  f"megatron-core {layout.megatron.version}")
    if dims.spec.megatron_source:
        console.print(f"Megatron names: {dims.spec.megatron_source}")
    if target is not None:
        console.print(_target_line(target, dims))


PLAN_COLUMNS = ("tp", "pp", "ep", "layers", "ops", "contiguous", "scratch", "bytes", "scratch_bytes")


def _print_rows(plan: Any, fmt: str, plan_s: float) -> None:
    """``--format json|csv``: one row per source rank and a total, for logs and scripts."""
    import csv
    import json

    summary = plan.summary()
    rows = [{"tp": r.tp, "pp": r.pp, "ep": r.ep, "layers": plan.layout.stage_layers[r.pp], **row}
            for r, row in sorted(summary["per_rank"].items(), key=lambda kv: (kv[0].pp, kv[0].tp, kv[0].ep))]
    total = {"tp": "total", "pp": "", "ep": "", "layers": plan.layout.num_layers, **summary["total"]}
    if fmt == "json":
        print(json.dumps({"layout": plan.layout.to_dict(), "dtype": plan.dtype, "sources": summary["sources"],
                          "targets": summary["targets"], "per_rank": rows, "total": summary["total"],
                          "digest": plan.digest, "planned_s": round(plan_s, 4)}, indent=1))
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=PLAN_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows + [total])


def _picture(args: argparse.Namespace, plan: Any, target: Any, dims: Any, layout: Any, fmt: Any) -> None:
    """``--svg``: one plan per vLLM worker of the engine (the other ranks planned too), or the HF plan."""
    import dataclasses

    from megarefit.cli.picture import draw

    if target is None:
        plans, names = [plan], ["HF receiver"]
    else:
        from megarefit.targets import plan_megatron_to_vllm

        workers = [dataclasses.replace(target, rank=r) for r in range(target.tp)]
        plans = [plan if w == target else plan_megatron_to_vllm(dims, layout, args.dtype, w, fmt) for w in workers]
        names = [f"vLLM tp rank {w.rank}" for w in workers]
    draw(args.svg, plans, names, f"{dims.family}: trainer tp={args.tp} pp={args.pp} ep={args.ep} -> "
                                 + ("HF tensors" if target is None else f"vLLM tp={target.tp}"))


def _vllm_target(args: argparse.Namespace) -> Any:
    """The ``--vllm-*`` options as a :class:`~megarefit.targets.VllmTarget`, or ``None``."""
    if not args.vllm_tp:
        for flag in ("vllm_rank", "vllm_dp_rank"):
            if getattr(args, flag, 0):
                raise MegarefitError(f"--{flag.replace('_', '-')} needs --vllm-tp")
        return None
    from megarefit.targets import VllmTarget

    return VllmTarget(args.vllm_tp, args.vllm_rank, dp=args.vllm_dp, dp_rank=args.vllm_dp_rank,
                      expert_parallel=args.vllm_ep, expert_placement=args.vllm_expert_placement)


def _target_line(target: Any, dims: Any) -> str:
    line = f"target: vLLM worker tp rank {target.rank} of tp={target.tp}"
    if target.dp > 1:
        line += f", dp rank {target.dp_rank} of dp={target.dp}"
    if dims.num_experts:
        experts = target.local_experts(dims.num_experts)
        if target.ep_size > 1:
            line += (f"; expert parallel: EP rank {target.ep_rank} of {target.ep_size}, {len(experts)} of "
                     f"{dims.num_experts} experts ({target.expert_placement})")
        else:
            line += f"; all {dims.num_experts} experts, split over moe tp={target.moe_tp} (rank {target.moe_rank})"
    return line + " (its own parameter shards, vLLM names)"


def _add_vllm_args(p: argparse.ArgumentParser) -> None:
    from megarefit.targets.vllm_layout import EXPERT_PLACEMENTS

    p.add_argument("--vllm-tp", type=int, default=0,
                   help="plan one vLLM worker's own parameter shards (vLLM tensor_parallel_size; default: full HF "
                        "tensors)")
    p.add_argument("--vllm-rank", type=int, default=0, help="that worker's tensor-parallel rank")
    p.add_argument("--vllm-dp", type=int, default=1, help="vLLM data_parallel_size (MoE layers span tp*dp workers)")
    p.add_argument("--vllm-dp-rank", type=int, default=0, help="that worker's data-parallel rank")
    p.add_argument("--vllm-ep", action="store_true", help="vLLM enable_expert_parallel (EP size tp*dp)")
    p.add_argument("--vllm-expert-placement", choices=EXPERT_PLACEMENTS, default="linear",
                   help="vLLM expert_placement_strategy (default linear)")


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    import torch

    from megarefit.demo.bench import bench_refit, layout_for, machine, plan_stream, random_shards

    if args.repeat < 1:
        raise MegarefitError(f"--repeat must be at least 1, got {args.repeat}")
    memory_budget = _memory_budget(args)
    dims, layout = layout_for(args.config, tp=args.tp, ep=args.ep, layers=args.layers)
    target = _vllm_target(args)
    if target is not None:
        from megarefit.targets import plan_megatron_to_vllm

        plan = plan_megatron_to_vllm(dims, layout, args.dtype, target)
    else:
        from megarefit.planner import plan_megatron_to_hf

        plan = plan_megatron_to_hf(dims, layout, args.dtype)
    # a budget too small fails here, before any shard exists
    stream = (memory_budget, *plan_stream(plan, memory_budget)) if memory_budget is not None else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shards = random_shards(plan, device, getattr(torch, plan.dtype))
    result = bench_refit(plan, device=device, repeat=args.repeat, shards=shards)
    console.print(f"machine: {escape(machine())}")
    what = _target_line(target, dims) if target is not None else "target: full HF tensors"
    console.print(f"{dims.family}, {dims.num_layers} layers, trainer tp={args.tp} ep={args.ep}, {args.dtype} on "
                  f"{device}; {what}; {_mb(result.bytes)}, {result.ops} ops")
    table = Table(title="warm refit vs one contiguous copy of the same bytes (best / median of "
                  f"{args.repeat}; ratio of medians)")
    for col in ("path", "best s", "median s", "GB/s (median)", "vs one contiguous copy"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for name, (best, median) in (("one contiguous copy (preallocated)", result.copy_s),
                                 ("megarefit warm refit (preallocated)", result.refit_s)):
        table.add_row(name, f"{best:.4f}", f"{median:.4f}", f"{result.bytes / median / 1e9:.1f}",
                      f"{result.copy_s[1] / median:.2f}x")
    console.print(table)
    if args.install is None:
        return 0
    return _bench_installs(args, console, plan, shards, device, stream)


def _memory_budget(args: argparse.Namespace) -> int | str | None:
    """``--memory-budget`` checked against ``--install``: bytes (an int), ``"auto"`` (also
    ``--install streamed`` without a budget) or ``None`` (no streamed install).

    Raises:
        MegarefitError: not a positive whole number of bytes nor ``auto``, or given without
            ``--install streamed``.
    """
    text = args.memory_budget
    if text is None:
        return "auto" if args.install == "streamed" else None
    if args.install != "streamed":
        raise MegarefitError("--memory-budget needs --install streamed (a staged install holds the whole share)")
    if text.strip().lower() == "auto":
        return "auto"
    try:
        budget = int(text)
    except ValueError:
        try:  # 2e9
            value = float(text)
            budget = int(value) if value.is_integer() else 0
        except ValueError:
            budget = 0
    if budget <= 0:
        raise MegarefitError(f"--memory-budget must be a positive number of bytes or 'auto', got {text!r}")
    return budget


def _bench_installs(args: argparse.Namespace, console: Console, plan: Any, shards: dict, device: str,
                    stream: tuple[int | str, int, list] | None) -> int:
    """The staged install and, with ``stream`` (the budget asked, in bytes, groups), the streamed
    one: warm seconds and extra memory of each; exit 1 when the streamed model differs from the staged."""
    from megarefit.demo.bench import bench_install, same_bits

    console.print(f"installs into the consumer's preallocated model (pulls + its copies; best / median of "
                  f"{args.repeat} warm cycles; extra MB: held above the model)")
    staged = bench_install(plan, shards, device=device, repeat=args.repeat)
    console.print(_install_line(staged, "the arena"))
    if stream is None:
        return 0
    asked, budget, groups = stream
    streamed = bench_install(plan, shards, groups=groups, device=device, repeat=args.repeat)
    console.print(_install_line(streamed, f"the ring; memory budget {'auto = ' if asked == 'auto' else ''}{budget} "
                                "bytes, all of it the ring: no NIXL scratch in-process", staged.seconds[0]))
    equal = same_bits(streamed.model, staged.model)
    console.print(f"equal to staged: {'yes' if equal else 'no'}")
    return 0 if equal else 1


def _install_line(r: Any, what: str, staged_s: float | None = None) -> str:
    """One install's line (:class:`~megarefit.demo.bench.InstallResult`); ``staged_s``: the staged best seconds."""
    best, median = r.seconds
    vs = f" ({best / staged_s:.2f}x staged)" if staged_s else ""
    line = (f"install {r.install}: {r.groups} group{'s' if r.groups != 1 else ''}, warm best {best:.4f} s / median "
            f"{median:.4f} s{vs}, extra MB {r.extra_bytes / 1e6:.2f} ({what})")
    if r.measured_extra_bytes is not None:
        line += f", measured on the GPU {r.measured_extra_bytes / 1e6:.2f} MB"
    return line


def cmd_name_map(args: argparse.Namespace, console: Console) -> int:
    from megarefit.cli.namemap import cmd_name_map as run

    cfg, dims, layout, _ = _layout(args)
    return run(args, console, cfg, dims, layout)


def _execute_on_meta(plan: Any) -> float:
    """Run every op against meta tensors (shapes only, no memory): exercises the executor's slicing."""
    import torch

    from megarefit.plan import TensorRef
    from megarefit.transport.execute import run_refit_cycle, torch_dtype
    from megarefit.transport.local import LocalTransport

    dtype = torch_dtype(plan.dtype)
    sources: dict[Any, dict[str, torch.Tensor]] = defaultdict(dict)
    for ref, meta in plan.sources.items():
        sources[ref.rank][ref.name] = torch.empty(meta.shape, dtype=dtype, device="meta")
    t0 = time.perf_counter()
    for name, tensor in run_refit_cycle(plan, LocalTransport(sources), device="meta"):
        if tuple(tensor.shape) != plan.targets[TensorRef(None, name)].shape:
            raise MegarefitError(f"executor produced {name} with shape {tuple(tensor.shape)}")
    return time.perf_counter() - t0


def progress(console: Console, status: Any) -> Callable[[str], None]:
    """The demos' ``status`` callback: each stage as a line on the console (``... trainer: building
    ...``), printed before the stage starts, so a pipe or a log shows what runs while the trainers
    spawn; on a terminal the spinner shows the stage too."""

    def update(message: str) -> None:
        console.print(f"... {escape(message)}", highlight=False)
        status.update(escape(message))

    return update


def cmd_live_demo(args: argparse.Namespace, console: Console) -> int:
    from megarefit.demo.live import run_live_demo

    if args.ep > 1 or args.etp or args.expert_layout != "sequential":
        raise MegarefitError("--ep / --etp / --expert-layout are for the local-transport demo; --transport nixl "
                             "builds dense trainers only")
    with console.status("starting") as status:
        result = run_live_demo(args.config, engine=args.engine, tp=args.tp, pp=args.pp, versions=args.versions,
                               shrink=args.shrink, status=progress(console, status))
    for note in result.notes:
        console.print(f"config: {escape(note)}")
    console.print(_model_line(result.dims, result.dims.padded_vocab_size(args.tp)))
    console.print(f"trainer: real Megatron-Core, tp={args.tp} pp={args.pp}, publishing live shards over NIXL "
                  f"(UCX); engine: {args.engine}; startup {result.startup_s['trainers + engine start']:.1f} s")
    stages = ("discover", "version", "plan", "prepare", "pull", "fence", "load")
    table = Table(title="refit cycles")
    table.add_column("", no_wrap=True)
    for c in result.cycles:
        table.add_column(f"v{c.version} ({'cold' if c.report['cold'] else 'warm'})", justify="right", no_wrap=True)
    for k in stages:
        table.add_row(f"{k} s", *(f"{c.report['seconds'].get(k, 0.0):.4f}" for c in result.cycles))
    table.add_row("bytes moved", *(_mb(c.report["bytes_moved"]) for c in result.cycles))
    table.add_row("NIXL registrations (total)", *(str(c.report["counters"]["registrations"]) for c in result.cycles))
    table.add_row("READ requests prepared (total)", *(str(c.report["counters"]["xfers"]) for c in result.cycles))
    table.add_row("greedy tokens == HF", *("[green]yes[/]" if c.match else "[red]no[/]" for c in result.cycles))
    console.print(table)
    last = result.cycles[-1].report if result.cycles else None
    if last is not None:
        console.print(f"bytes moved per cycle {_mb(last['bytes_moved'])} = model bytes {_mb(last['model_bytes'])}; "
                      "warm cycles registered and prepared nothing new" if result.passed else "")
    verdict = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    console.print(f"greedy generation after every refit matches HF transformers with the trainer's weights, "
                  f"warm cycles allocate/register nothing: {verdict}")
    return 0 if result.passed else 1


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from megarefit.demo.offline import FP8_COSINE, FP8_TOLERANCE, TOLERANCE, run_demo

    if args.transport == "nixl":
        return cmd_live_demo(args, console)
    if args.engine != "hf":
        raise MegarefitError("--engine vllm needs --transport nixl (the local transport refits HF models)")

    with console.status("starting") as status:
        result = run_demo(args.config, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, seq=args.seq,
                          expert_layout=args.expert_layout,
                          quantization=args.quantization, shrink=args.shrink, status=progress(console, status))
    plan, stats = result.plan, result.stats
    for note in result.notes:
        console.print(f"config: {escape(note)}")
    console.print(_model_line(result.dims, plan.layout.padded_vocab_size))
    experts = f", {plan.layout.expert_layout} experts" if result.dims.num_experts else ""
    model_class = "MambaModel" if result.dims.layer_pattern else "GPTModel"
    console.print(f"trainer: real Megatron-Core {model_class}, tp={args.tp} pp={args.pp} ep={args.ep} "
                  f"etp={plan.layout.etp}{experts} on gloo (CPU, fp32), megatron-core {plan.layout.megatron.version}; "
                  f"target: HF transformers {escape(str(result.config['architectures'][0]))}")
    console.print(plan_table(plan, per_rank=True))
    times = Table(title="refit stages")
    times.add_column("stage")
    times.add_column("seconds", justify="right")
    for stage, seconds in result.stages.items():
        times.add_row(stage, f"{seconds:.3f}")
    console.print(times)
    console.print(f"refit: {stats.tensors} HF tensors installed ({result.loaded} names checked), "
                  f"{_mb(stats.bytes_copied)} copied, {stats.views} zero-copy views ({_mb(stats.bytes_viewed)})")
    verdict = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    if result.quantization is not None:
        receiver = [w.removeprefix("receiver: ") for w in result.where.values() if w != "trainer"]
        console.print(_fp8_line(len(result.where), receiver, result.quantization, plan.nbytes,
                                result.unquantized_bytes, "float32"))
        console.print(f"FP8's own error: HF logits vs fp32 Megatron logits max |diff| = {result.max_logit_diff:.3e} = "
                      f"{result.relative_error:.4f} of the logit scale {result.logit_scale:.2f}, cosine "
                      f"{result.cosine:.6f} (block FP8 on random weights; typical < {FP8_TOLERANCE:g} and > "
                      f"{FP8_COSINE:g}: information)")
        console.print(f"max |FP8 refit logits - logits of the same weights quantized whole| = "
                      f"{result.reference_diff:.3e} (tolerance {TOLERANCE:g}): {verdict}")
        return 0 if result.passed else 1
    console.print(f"max |HF logits - Megatron logits| = {result.max_logit_diff:.3e} "
                  f"(logit scale {result.logit_scale:.2f}, tolerance {TOLERANCE:g}): {verdict}")
    return 0 if result.passed else 1


def _fp8_line(weights: int, receiver: list[str], fmt: Any, nbytes: int, unquantized: int, dtype: str) -> str:
    """``weights`` FP8 weights, of which ``receiver`` (their reasons) are quantized after the pull."""
    line = (f"block FP8 {fmt.block[0]}x{fmt.block[1]}{' (UE8M0 scales)' if fmt.ue8m0 else ''}: {weights} weights, "
            f"{weights - len(receiver)} quantized on the trainers, {len(receiver)} on the receiver")
    if receiver:
        line += f" (e.g. {escape(receiver[0])})"
    return line + f"; {_mb(nbytes)} on the wire vs {_mb(unquantized)} in {dtype} ({nbytes / unquantized:.2f}x)"


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def device_arg(value: str) -> str:
    """argparse type: a torch device this process can use (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {value!r}: use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {value!r}: only cpu and cuda[:N] are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {value!r}: this torch ({torch.__version__}) sees no CUDA device; "
                                         "use --device cpu")
    return value


def output_path(value: str) -> str:
    """argparse type: a file path whose directory exists (checked before any work starts)."""
    parent = Path(value).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {value!r}: directory {str(parent)!r} does not exist")
    return value


def picture_path(value: str) -> str:
    """argparse type: :func:`output_path` whose suffix names a picture format the plot writes."""
    from megarefit.cli.picture import check_picture_path

    try:
        check_picture_path(value)
    except MegarefitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return output_path(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarefit", description="Megatron-Core -> HF / vLLM weight refits: "
                                     "plan, check and time them. `megarefit COMMAND --help` for each command.")
    parser.add_argument("--version", action="version", version=f"megarefit {megarefit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="real Megatron-Core -> HF refit on CPU, with a logits check")
    _add_demo_args(demo)
    demo.set_defaults(func=cmd_demo)

    plan = sub.add_parser("plan", help="build and validate a refit plan from shapes alone")
    _add_layout_args(plan)
    plan.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    plan.add_argument("--quantization", choices=["auto", "fp8", "none"], default="auto",
                      help="refit target format: auto (default) follows the config's quantization_config "
                           "(an FP8 serving config means block-FP8 targets), fp8, or none")
    plan.add_argument("--per-rank", action="store_true", help="one table row per source rank")
    plan.add_argument("--format", choices=["table", "json", "csv"], default="table",
                      help="table (default, for people), or json / csv: one row per source rank and a total, "
                           "nothing else on stdout (for logs and scripts)")
    plan.add_argument("--execute-meta", dest="execute_meta", action="store_true", default=False,
                      help="also run every op through the executor on meta tensors, one op at a time (validation "
                           "already proves bounds, lengths and exact cover; this adds the executor's views; "
                           "slow for large MoE plans: +12 s for DeepSeek-V3 tp8 ep64)")
    plan.add_argument("--no-execute-meta", dest="execute_meta", action="store_false",
                      help="the default: validation only")
    plan.add_argument("--json", metavar="FILE", type=output_path, help="write the serialized plan")
    plan.add_argument("--svg", metavar="FILE", type=picture_path,
                      help="draw bytes per trainer rank and receiver (every vLLM worker with --vllm-tp), and which "
                           "are strided, as SVG/PNG/PDF by the suffix (needs matplotlib: megarefit[bench])")
    _add_vllm_args(plan)
    plan.add_argument("--dp", type=int, default=0,
                      help="the trainer's data-parallel size (with context parallel: dp x cp); every copy serves. "
                           "Prints the bytes each trainer GPU serves to whole vLLM engines (every worker's plan "
                           "summed, holders chosen as receivers choose them)")
    plan.add_argument("--replicas", type=int, default=1, help="with --dp: how many vLLM engines read (default 1)")
    plan.add_argument("--served-json", metavar="FILE", type=output_path,
                      help="write the bytes each trainer GPU serves as JSON")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="time a warm refit against a plain copy of the same bytes, on this machine")
    _add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    names = sub.add_parser("name-map", help="Megatron -> HF name map; with --from-bridge, checked against "
                                            "Megatron-Bridge")
    _add_layout_args(names)
    names.add_argument("--from-bridge", action="store_true",
                       help="look every parameter up in Megatron-Bridge's mapping registry and report "
                            "disagreements (exit 1 if any)")
    names.add_argument("--patterns", action="store_true", help="print Bridge's registry patterns (with --from-bridge)")
    names.add_argument("--format", choices=["table", "json"], default="table",
                       help="table (default) or json (layout and one entry per Megatron parameter)")
    names.set_defaults(func=cmd_name_map)
    return parser


def _add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="HF config.json, or a directory holding one (default: a small "
                                    "Qwen3-architecture config); a large config is shrunk to a CPU-sized model "
                                    "of the same architecture")
    p.add_argument("--tp", type=positive_int, default=2, help="trainer tensor-parallel size (default 2)")
    p.add_argument("--pp", type=positive_int, default=1, help="trainer pipeline-parallel size (default 1)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="trainer expert-parallel size, MoE configs (default 1; tp*pp*ep processes)")
    p.add_argument("--etp", type=positive_int, help="expert tensor-parallel size: 1 or tp (default: tp; 1 for experts with biases)")
    p.add_argument("--expert-layout", choices=["sequential", "legacy_grouped", "te_grouped"], default="sequential",
                   help="Megatron experts module, MoE configs: sequential (SequentialMLP, default) or "
                        "legacy_grouped (GroupedMLP); te_grouped needs Transformer Engine (GPU)")
    p.add_argument("--no-shrink", dest="shrink", action="store_false",
                   help="build the config as given (default: shrink configs too large for a CPU demo)")
    p.add_argument("--seq", type=positive_int, default=16, help="tokens per sequence in the logits check")
    p.add_argument("--transport", choices=["local", "nixl"], default="local",
                   help="local: in-process shards (default); nixl: trainers serve live shards over NIXL")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="refit target: HF transformers (default) or a real vLLM engine (needs --transport nixl)")
    p.add_argument("--versions", type=positive_int, default=2, help="weight versions to refit with --transport nixl")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: block-FP8 refit (trainer-side where blocks allow), logits compared within FP8 "
                        "tolerance")


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="HF config.json (or a directory holding one)")
    p.add_argument("--tp", type=positive_int, default=2, help="trainer tensor-parallel size (default 2)")
    p.add_argument("--ep", type=positive_int, default=1, help="trainer expert-parallel size (default 1)")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--device", type=device_arg, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--repeat", type=int, default=5, help="warm cycles to time (default 5)")
    p.add_argument("--install", choices=["staged", "streamed"],
                   help="also time an install into a preallocated consumer model and print its extra memory: "
                        "staged (whole share in an arena) or streamed (layer groups through one ring; staged "
                        "too, for comparison, and checked bit for bit against it)")
    p.add_argument("--memory-budget", metavar="BYTES|auto",
                   help="memory budget of the streamed install, in bytes (the ring gets all of it: the "
                        "in-process transport needs no NIXL scratch); auto (default): the larger of 1 GiB and "
                        "the budget holding the two largest layers")
    _add_vllm_args(p)


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="HF config.json (or a directory holding one)")
    p.add_argument("--tp", type=positive_int, default=1, help="trainer tensor-parallel size (default 1)")
    p.add_argument("--pp", type=positive_int, default=1, help="trainer pipeline-parallel size (default 1)")
    p.add_argument("--ep", type=positive_int, default=1, help="trainer expert-parallel size (default 1)")
    p.add_argument("--etp", type=positive_int, help="expert tensor parallel size: 1 or tp (default: tp; 1 for experts with biases)")
    p.add_argument("--expert-layout", choices=["sequential", "te_grouped", "legacy_grouped"], default="te_grouped",
                   help="expert storage (default: te_grouped)")
    p.add_argument("--first-stage-layers", type=int, help="Megatron num_layers_in_first_pipeline_stage")
    p.add_argument("--last-stage-layers", type=int, help="Megatron num_layers_in_last_pipeline_stage")
    p.add_argument("--layer-spec", choices=["local", "te"], default="te",
                   help="norm spelling of the trainer's layer spec (default: te)")
    p.add_argument("--vocab-divisible-by", type=positive_int, default=128, help="make_vocab_size_divisible_by")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="Megatron mtp_num_layers: multi-token-prediction layers on the last stage (default 0)")
    p.add_argument("--megatron-version", metavar="VERSION",
                   help=f"the trainer's megatron-core, whose release names and lays out some parameters; its "
                        f"config flags are taken at their verified values (verified: {', '.join(VERIFIED_VERSIONS)}; "
                        "default: the megatron-core installed here)")


PIPE_WIDTH = 10_000  # columns of a console that is not a terminal: no table is cut


def stdout_console() -> Console:
    """The console the commands print to: a terminal's own width; in a pipe or a log (no
    terminal), :data:`PIPE_WIDTH` columns, so tables keep whole headers and names. Long lines
    are never wrapped (they stay greppable)."""
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console = Console(soft_wrap=True, width=PIPE_WIDTH)
    return console


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = stdout_console()
    try:
        return args.func(args, console)
    except (MegarefitError, OSError) as exc:  # bad input: one line, no traceback
        # the message is text, not markup: `pip install 'megarefit[nixl]'` keeps its brackets
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
