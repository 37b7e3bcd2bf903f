"""examples/rl_http.py as a user meets it, without vLLM: inputs refused before anything starts,
and a trainer worker's error in one line (its whole traceback behind ``--verbose``).

Each case runs the example as a user does (a subprocess) and judges its stderr: one line, naming
the file / the architecture / the failing exception. The worker case spawns one real Megatron-Core
trainer (gloo, CPU) against a real rendezvous and a server address nothing listens on, so the error
is raised inside the worker, as a real run's would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megarefit.demo.workers import free_port
from megarefit.specs import FAMILIES

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_http.py"
SECRET = "test-example-inputs-secret"
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 32}


def example(*argv: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(EXAMPLE), *argv], capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, MEGAREFIT_JOB_SECRET=SECRET, **(env or {})))
    return run, time.monotonic() - t0


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """stderr without what the trainer processes log as they start (NIXL's agent lines, Megatron-Core's
    UserWarnings about Transformer Engine: each a warning line and its source line)."""
    lines = [line for line in run.stderr.splitlines() if line.strip() and " NIXL " not in line]
    warned = {i for i, line in enumerate(lines) if "Warning: " in line and not line.startswith(("error:", " "))}
    return [line for i, line in enumerate(lines) if i not in warned and i - 1 not in warned]


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_missing_config_is_one_line_naming_the_file(command, tmp_path):
    missing = tmp_path / "nope" / "config.json"
    where = (["--rendezvous", "127.0.0.1:1", "--server", "http://127.0.0.1:1", "--model-name", "m"]
             if command == "train" else ["--workdir", str(tmp_path / "work")])
    run, seconds = example(command, *where, "--config", str(missing))
    assert run.returncode != 0
    assert error_lines(run) == [f"error: --config {missing}: HF config {str(missing)!r} does not exist"], run.stderr
    assert not (tmp_path / "work").exists()  # nothing started: no checkpoint written
    assert seconds < 60


@pytest.mark.parametrize("command", ["train", "demo", "checkpoint"])
def test_an_unsupported_family_is_refused_before_anything_starts(command, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA2))
    where = {"train": ["--rendezvous", "127.0.0.1:1", "--server", "http://127.0.0.1:1", "--model-name", "m"],
             "demo": ["--workdir", str(tmp_path / "work")], "checkpoint": [str(tmp_path / "work")]}[command]
    run, seconds = example(command, *where, "--config", str(config))
    assert run.returncode != 0
    lines = error_lines(run)
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"error: --config {config}: architecture 'Gemma2ForCausalLM'"), lines
    supported = {a for f in FAMILIES for a in f.architectures}
    assert "Qwen3ForCausalLM" in supported and all(repr(a) in lines[0] for a in supported), lines
    assert not (tmp_path / "work").exists()  # no checkpoint written, no vLLM started
    assert seconds < 60


def test_a_bad_rendezvous_address_is_one_line():
    run, _ = example("train", "--rendezvous", "nohost", "--server", "http://127.0.0.1:1", "--model-name", "m")
    assert run.returncode != 0 and error_lines(run) == [
        "error: --rendezvous 'nohost': expected HOST:PORT, e.g. 127.0.0.1:29600"], run.stderr


def test_an_unreachable_server_is_one_line_before_the_trainers_start():
    port = free_port()  # nothing listens there
    run, _ = example("train", "--rendezvous", "127.0.0.1:1", "--server", f"http://127.0.0.1:{port}")
    lines = error_lines(run)
    assert run.returncode != 0 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"error: --server http://127.0.0.1:{port}: GET /v1/models"), lines


@pytest.fixture(scope="module")
def rendezvous():
    from megarefit.online.store.rendezvous import Rendezvous

    rdzv = Rendezvous.serve(job="rl", secret=SECRET)
    yield rdzv
    rdzv.store.close()


@pytest.mark.megatron
@pytest.mark.parametrize("verbose", [None, "--verbose", "env"])
def test_an_error_in_a_trainer_worker_is_one_line(rendezvous, verbose):
    pytest.importorskip("megatron.core")
    port = free_port()  # the "server": nothing listens there, so rank 0's init fails inside the worker
    argv = ["train", "--tp", "1", "--rendezvous", f"127.0.0.1:{rendezvous.port}", "--server",
            f"http://127.0.0.1:{port}", "--model-name", "m", "--steps", "1"]
    run, seconds = example(*argv, *([verbose] if verbose == "--verbose" else []),
                           env={"MEGAREFIT_VERBOSE": "1"} if verbose == "env" else None, timeout=180)
    assert run.returncode != 0
    lines = error_lines(run)
    raised = ("RefitHTTPError: vLLM /init_weight_transfer_engine failed (no response): "
              "<urlopen error [Errno 111] Connection refused>")
    if verbose is None:
        assert lines == [f"error: trainer rank 0 failed: {raised} (the whole traceback: --verbose or "
                         "MEGAREFIT_VERBOSE=1)"], run.stderr
    else:  # the worker's traceback (its frames in the example and vllm_http), then the parent's
        text = "\n".join(lines)
        assert "in trainer\n" in text and "vllm_http.py" in text and "in _call" in text, text
        assert lines[-1] == f"TrainerFailed: trainer rank 0 failed: {raised}", lines[-3:]
    assert seconds < 120


class RotaryEmbedding(torch.nn.Module):  # as vLLM's: a computed cos/sin cache, a buffer in no checkpoint
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2), persistent=False)


class ParallelLMHead(torch.nn.Module):
    def __init__(self, tied: torch.nn.Parameter | None) -> None:
        super().__init__()
        self.weight = tied if tied is not None else torch.nn.Parameter(torch.ones(8, 2))


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 2)
        self.rotary_emb = RotaryEmbedding()
        self.lm_head = ParallelLMHead(self.embed_tokens.weight if tied else None)


@pytest.mark.parametrize("tied", [True, False])
def test_vllms_failed_to_load_lines_are_demoted_only_where_expected(tied):
    """vLLM's own reload logger (a real vLLM 0.32 logger, its handler at INFO) logs the warning its
    layerwise.py logs, for each layer class: a cache-only layer and a tied head are demoted to DEBUG
    and explained; an untied head (its weight its own: a refit that misses it is a bug) and the
    embedding stay warnings."""
    pytest.importorskip("vllm")
    import logging

    from vllm.logger import init_logger

    from megarefit.integrations.vllm_install import RELOAD_LOGGER, explain_unloaded, never_loaded

    import inspect

    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise.logger.name == RELOAD_LOGGER  # the filter sits where vLLM logs, on what it logs
    assert 'logger.warning("%s: Failed to load weights", layer.__class__.__name__)' in inspect.getsource(layerwise)
    model = Tiny(tied)
    assert never_loaded(model) == ({"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"})
    log = init_logger(RELOAD_LOGGER)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = seen.append
    log.addHandler(handler)
    filt = explain_unloaded(model)
    try:
        for layer in ("RotaryEmbedding", "ParallelLMHead", "Embedding"):
            log.warning("%s: Failed to load weights", layer)  # vLLM's layerwise.py:266, word for word
    finally:
        log.removeHandler(handler)
        log.removeFilter(filt)
    warned = [r.getMessage() for r in seen]
    want = ["Embedding: Failed to load weights"] if tied else [
        "ParallelLMHead: Failed to load weights", "Embedding: Failed to load weights"]
    assert warned == want and all(r.levelno == logging.WARNING for r in seen), warned
