"""Prefetch beside generation on a GPU: how much the pull slows the model, and what is left to pause for.

    python benchmarks/bench_prefetch_gpu.py --config tests/data/configs/Qwen3-8B.json --tp 2 --vllm-tp 2 \\
        --trainer-device cuda:0 --device cuda:1 --json docs/prefetch_gpu_h200.jsonl
    python benchmarks/bench_prefetch_gpu.py --from-json docs/prefetch_gpu_h200.jsonl

Trainer processes on ``--trainer-device`` serve random shards (``bench_nixl.trainer``: real
Publishers); this process's staged receiver on ``--device`` pulls vLLM worker 0's own shards.
Real GPU vLLM cannot be installed on the lent machines, so generation is a stand-in on the
receiver's GPU: decode-like steps (``--batch`` tokens through a gate/up and a down projection
of the model's sizes, per layer), each step synchronized as vLLM's engine loop is once per step.
All from one run, on one machine, medians (range) over ``--cycles``:

    step alone          a generation step with nothing else on the GPU
    step during pull    generation steps while RefitReceiver.prefetch pulls on its thread
    pull alone          a staged cycle of the same bytes with the GPU otherwise idle
    prefetch            the same pull beside generation (RefitReceiver.prefetch until ready)
    install             the prefetched arena copied into the worker's parameters, generation paused
    stall               the gap between the generation steps around that pause, and around a pause
                        that pulls and installs (the same refit without prefetch)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


class Generation:
    """Decode-like steps on ``device`` on a thread (a stand-in for vLLM generating): per layer,
    ``[batch, hidden] @ [hidden, 2*ffn]`` then ``[batch, ffn] @ [ffn, hidden]`` in bf16, one sync
    per step; ``steps`` holds ``(start, seconds)`` of every step."""

    def __init__(self, device: str, hidden: int, ffn: int, layers: int, batch: int):
        self.device = torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(0)
        self.x = torch.randn(batch, hidden, device=self.device, dtype=torch.bfloat16, generator=g)
        self.up = torch.randn(hidden, 2 * ffn, device=self.device, dtype=torch.bfloat16, generator=g) / hidden**0.5
        self.down = torch.randn(ffn, hidden, device=self.device, dtype=torch.bfloat16, generator=g) / ffn**0.5
        self.layers, self.ffn = layers, ffn
        self.steps: list[tuple[float, float]] = []
        self._stop, self._go, self._idle = threading.Event(), threading.Event(), threading.Event()
        self._go.set()

    def step(self) -> None:
        x = self.x
        with torch.cuda.device(self.device):
            for _ in range(self.layers):
                h = x @ self.up
                x = torch.nn.functional.silu(h[:, :self.ffn]) * h[:, self.ffn:] @ self.down
            torch.cuda.current_stream(self.device).synchronize()

    def run(self) -> None:
        while not self._stop.is_set():
            if not self._go.is_set():  # paused (as vLLM's /pause): no step until resumed
                self._idle.set()
                self._go.wait()
                self._idle.clear()
                continue
            t0 = time.perf_counter()
            self.step()
            self.steps.append((t0, time.perf_counter() - t0))

    def pause(self) -> None:
        """Stop stepping once the current step is done (returns then)."""
        self._go.clear()
        self._idle.wait()

    def resume(self) -> None:
        self._go.set()

    def gap(self, t0: float, t1: float) -> float:
        """From the end of the last step finished before ``t0`` to the start of the first after ``t1``."""
        before = max(start + s for start, s in self.steps if start + s <= t0)
        after = min(start for start, _ in self.steps if start >= t1)
        return after - before

    def between(self, t0: float, t1: float) -> list[float]:
        return [s for start, s in self.steps if t0 <= start and start + s <= t1]

    def __enter__(self) -> Generation:
        for _ in range(3):
            self.step()  # cuBLAS set up
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _install(got: dict[str, torch.Tensor], params: dict[str, torch.Tensor], device: str) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for name, tensor in got.items():
        params[name].copy_(tensor)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(rdzv, ns: argparse.Namespace, cfg: dict) -> dict:
    from megarefit.online import RefitReceiver
    from megarefit.targets import VllmTarget

    rx = RefitReceiver(rdzv, name="bench-prefetch-rx", device=ns.device, timeout=600, delta=False,
                       target=VllmTarget(ns.vllm_tp, 0) if ns.vllm_tp else None)
    params = {n: torch.empty_like(t) for n, t in rx.run_refit_cycle(1)}  # cold; the worker's "parameters"
    pull_alone = []
    for _ in range(ns.cycles):
        torch.cuda.synchronize(ns.device)
        t0 = time.perf_counter()
        dict(rx.run_refit_cycle(1))
        pull_alone.append(time.perf_counter() - t0)
    gen = Generation(ns.device, cfg["hidden_size"], cfg["intermediate_size"], ns.gen_layers, ns.batch)
    prefetch, install, during, alone, stall, stall_pulled = [], [], [], [], [], []
    with gen:
        for _ in range(ns.cycles):
            time.sleep(0.3)
            t0 = time.perf_counter()
            alone += gen.between(t0 - 0.3, t0)
            rx.prefetch(1)
            while rx.prefetched.phase == "pulling":
                time.sleep(0.0005)
            t1 = time.perf_counter()
            prefetch.append(t1 - t0)
            during += gen.between(t0, t1)
            assert rx.prefetched.phase == "ready", rx.prefetched
            t_pause = time.perf_counter()
            gen.pause()
            install.append(_install(dict(rx.run_refit_cycle(1)), params, ns.device))
            t_resume = time.perf_counter()
            gen.resume()
            time.sleep(0.05)
            stall.append(gen.gap(t_pause, t_resume))
            t_pause = time.perf_counter()  # the same refit without prefetch: pull and install in the pause
            gen.pause()
            _install(dict(rx.run_refit_cycle(1)), params, ns.device)
            t_resume = time.perf_counter()
            gen.resume()
            time.sleep(0.05)
            stall_pulled.append(gen.gap(t_pause, t_resume))
    share = sum(t.numel() * t.element_size() for t in params.values())
    rx.close()
    return {"share_bytes": share, "tensors": len(params), "pull_alone_s": pull_alone, "prefetch_s": prefetch,
            "install_s": install, "stall_s": stall, "stall_pulled_s": stall_pulled, "step_alone_s": alone, "step_during_s": during}


def _med(xs: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(xs) * scale:.1f} ({min(xs) * scale:.1f}-{max(xs) * scale:.1f})"


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        slow = statistics.median(r["step_during_s"]) / statistics.median(r["step_alone_s"])
        ratio = statistics.median(r["stall_s"]) / statistics.median(r["stall_pulled_s"])
        lines += [f"{r['machine']}; {r['date']}; {r['config']}, trainer tp {r['tp']} on {r['trainer_device']} -> "
                  f"vLLM worker 0 of tp {r['vllm_tp']} on {r['device']} ({r['tensors']} tensors, "
                  f"{r['share_bytes'] / 2**30:.2f} GiB); generation stand-in: {r['gen_layers']} layers x "
                  f"batch {r['batch']}", "",
                  "| | median ms (range) |", "|---|---|",
                  f"| generation step alone | {_med(r['step_alone_s'])} |",
                  f"| generation step during the prefetch | {_med(r['step_during_s'])} ({slow:.2f}x) |",
                  f"| pull alone (staged cycle) | {_med(r['pull_alone_s'])} |",
                  f"| prefetch beside generation | {_med(r['prefetch_s'])} |",
                  f"| install: the pause (copies into the parameters) | {_med(r['install_s'])} |",
                  f"| generation stall, prefetched: pause, install, resume (gap between steps) | {_med(r['stall_s'])} |",
                  f"| generation stall, not prefetched: pause, pull, install, resume | {_med(r['stall_pulled_s'])} |",
                  f"| stall with prefetch / without (medians) | {ratio:.1%} |", ""]
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    from bench_nixl import trainer
    from bench_streamed_nixl import _args, _parser

    from megarefit.demo.bench import append_jsonl, bench_config, machine, read_jsonl
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ap = _parser()
    ap.description = __doc__.splitlines()[0]
    ap.add_argument("--gen-layers", type=int, default=8, help="layers per generation step")
    ap.add_argument("--batch", type=int, default=64, help="tokens per generation step")
    ns = ap.parse_args(argv)
    if ns.from_json:
        print(table(read_jsonl(ns.from_json)))
        return 0
    cfg = bench_config(ns.config, ns.layers)
    ensure_job_secret()
    rdzv = Rendezvous.serve(job="bench")
    args = _args(ns)
    from bench_nixl import _setup

    _dims, layout, _plan = _setup(cfg, args)
    group = start_workers(trainer, world_size=len(layout.ranks()), args=(rdzv.port, cfg, args))
    row = measure(rdzv, ns, cfg)
    rdzv.mark_consumed(1)
    group.join(timeout=300)
    row = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "config": Path(ns.config).stem,
           "tp": ns.tp, "vllm_tp": ns.vllm_tp, "trainer_device": ns.trainer_device, "device": ns.device,
           "gen_layers": ns.gen_layers, "batch": ns.batch, **row}
    print(table([row]), flush=True)
    if ns.json:
        append_jsonl(ns.json, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
