"""examples/rl_http.py runs as docs/http.md says: ``python examples/rl_http.py demo`` (a real
``vllm serve`` on CPU started by the example's own ``serve`` command, two real Megatron-Core
trainer processes taking real SGD steps, the controller refitting the server after each step).

The oracle shares no code with megarefit's conversion: the trainers' saved Megatron shards are
mapped back to HF names by inverting tests/reference.py's independent HF -> Megatron layout
(its transpose, by autograd: every HF element lands in the shards, replicas averaged), checked
to map forward to exactly those shards, loaded into HF transformers' own Qwen3 model, and
HF's greedy tokens must equal the server's rollouts after every step.
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

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from reference import reference_shards  # noqa: E402

pytestmark = pytest.mark.megatron
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_http.py"
sys.path.insert(0, str(EXAMPLE.parent))
import rl_http  # noqa: E402  (the example's prompts and rollout length)
STEPS = 2


def hf_from_shards(shards: dict, cfg: dict, tp: int) -> dict[str, torch.Tensor]:
    """The HF state whose :func:`reference_shards` are ``shards`` (``{(t, 0, 0): {name: tensor}}``)."""
    shapes = _hf_shapes(cfg)
    names = list(shapes)
    probe = {n: torch.zeros(s, dtype=torch.float64, requires_grad=True) for n, s in shapes.items()}
    mapped = reference_shards(probe, cfg, tp=tp, pp=1)  # linear in probe: its transpose is autograd's
    total = sum(t.sum() for r in mapped for t in mapped[r].values())
    counts = torch.autograd.grad(total, [probe[n] for n in names], retain_graph=True, allow_unused=True)
    dot = sum((mapped[r][n] * shards[r][n].double()).sum() for r in mapped for n in mapped[r])
    sums = torch.autograd.grad(dot, [probe[n] for n in names], allow_unused=True)
    hf = {}
    for n, c, s in zip(names, counts, sums, strict=True):
        assert c is not None and bool((c > 0).all()), f"{n}: not every element reaches the shards"
        hf[n] = (s / c).float()
    again = reference_shards(hf, cfg, tp=tp, pp=1)
    reach = reference_shards({n: torch.ones(s) for n, s in shapes.items()}, cfg, tp=tp, pp=1)
    for r in again:  # forward again: exactly the shards, but for the vocabulary's padding rows
        assert again[r].keys() == shards[r].keys(), (sorted(again[r]), sorted(shards[r]))
        for n in again[r]:
            real = reach[r][n] > 0
            torch.testing.assert_close(again[r][n][real], shards[r][n].float()[real], rtol=0, atol=0, msg=n)
    return hf


def _hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of ``cfg``'s tied Qwen3 model and its shape, from transformers itself."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg))
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}


@torch.no_grad()
def hf_greedy(hf: dict, cfg: dict, directory: Path, prompts, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """HF transformers' greedy tokens and their logprobs after a save_pretrained / from_pretrained
    round trip."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg), dtype=torch.float32)
    model.load_state_dict(hf, strict=False)
    model.tie_weights()
    model.save_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids, logprobs = torch.tensor([p]), []
        for _ in range(max_tokens):
            lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            ids = torch.cat([ids, lp.argmax().reshape(1, 1)], dim=1)
            logprobs.append(float(lp.max()))
        out.append((ids[0, len(p):].tolist(), logprobs))
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("rl_http")
    env = dict(os.environ, MEGAREFIT_JOB_SECRET="test-example-secret")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(EXAMPLE), "demo", "--workdir", str(work), "--steps", str(STEPS)],
                         env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    print(f"demo took {seconds:.1f} s:\n{run.stdout}")
    return work, json.loads((work / "out" / "log.json").read_text()), run.stdout, run.stderr


def test_the_demo_trains_and_refits_every_step(demo):
    _, log, stdout, stderr = demo
    assert sorted(log["loss"]) == sorted(log["refit_s"]) == [str(s) for s in range(1, STEPS + 1)]
    assert all(s in stdout for s in ("step 1: loss", f"step {STEPS}: loss"))
    losses = [log["loss"][str(s)] for s in range(1, STEPS + 1)]
    assert losses[-1] < losses[0], losses  # real SGD steps on one batch: the loss falls
    # the tied lm_head and the rotary cache get nothing on every refit: vLLM's warning demoted (docs/http.md)
    assert "Failed to load weights" not in stdout + stderr


@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_the_server_serves_the_trainers_weights_after_each_step(demo, step, tmp_path):
    work, log, _, _ = demo
    cfg = json.loads((work / "config.json").read_text())
    shards = {(t, 0, 0): torch.load(work / "out" / f"step{step}-tp{t}.pt") for t in range(2)}
    want = hf_greedy(hf_from_shards(shards, cfg, tp=2), cfg, tmp_path, rl_http.PROMPTS, rl_http.MAX_TOKENS)
    served = log["rollouts"][str(step)]["0"]
    for got, (tokens, logprobs) in zip(served, want, strict=True):
        assert got["tokens"] == tokens, (served, want)
        assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs, strict=True)) < 1e-3, (served, want)
    if step > 1:  # each step changed what is served
        assert served != log["rollouts"][str(step - 1)]["0"]
