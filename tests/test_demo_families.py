"""`megarefit demo` on the newer families' real configs: real Megatron-Core builds each on CPU and
transformers' own model gives its logits after the refit (gpt-oss, Nemotron-H, MiniMax-M2). A module of its
own so pytest-xdist can run it beside test_cli.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _demo_says(config: str, *words: str, layout: tuple[str, ...] = ()) -> None:
    """``megarefit demo --config tests/data/configs/<config> <layout>`` passes and prints each of ``words``."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    cfg = Path(__file__).parent / "data" / "configs" / config
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--config", str(cfg), *layout],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    for w in words + ("max |HF logits - Megatron logits|", "PASS"):
        assert w in out, (w, proc.stdout)


@pytest.mark.megatron
@pytest.mark.parametrize("layout", [["--tp", "2"]])  # also at --ep 2 and --pp 2 (twice the processes; README)
def test_demo_gpt_oss_matches_real_megatron(layout):
    """`megarefit demo --config gpt-oss-120b.json`: real Megatron-Core builds gpt-oss on CPU
    (learned attention sinks, biased router and experts, clamped quick-GELU GLU with the
    +1 offset, sliding windows of 4 tokens in every other layer, YaRN) and transformers' own
    GptOssForCausalLM gives the same logits after the refit, with the experts' gate/up
    interleaved into one gate_up_proj per layer; attention and sinks split over tp 2, experts whole
    on each rank (etp 1, the default for biased experts); EP trainers run in
    test_vllm_refit_families.py."""
    _demo_says("gpt-oss-120b.json", "sliding_window 128 -> 4", "layer_types cut to the first 2", "GptOssForCausalLM",
               layout=tuple(layout))


@pytest.mark.megatron
def test_demo_nemotron_h_matches_real_megatron():
    """`megarefit demo --config NVIDIA-Nemotron-3-Nano-30B-A3B.json`: real Megatron-Core builds the
    hybrid as MambaModel on CPU (one Mamba2, one MoE and one attention layer, the SSD scan in torch;
    tp 2: in_proj / conv1d split part by part, experts and the shared expert split over expert TP)
    and transformers' own NemotronHForCausalLM gives the same logits after the refit."""
    _demo_says("NVIDIA-Nemotron-3-Nano-30B-A3B.json", "hybrid_override_pattern MEMEM", "-> ME*",
               "real Megatron-Core MambaModel, tp=2", "NemotronHForCausalLM")


@pytest.mark.megatron
def test_demo_minimax_m2_matches_real_megatron():
    """`megarefit demo --config MiniMax-M2.5.json`: real Megatron-Core builds MiniMax-M2 on CPU at tp 2
    with the harness's q / k norms over all heads (the sum of squares all-reduced over TP), sigmoid
    routing with a score-correction bias and RoPE on half of each shrunk head (8 of 16 dims,
    ``rotary_dim`` scaled with ``head_dim``); transformers' own MiniMaxM2ForCausalLM gives the same
    logits after the refit."""
    _demo_says("MiniMax-M2.5.json", "rotary_dim 64 -> 8", "tp=2", "MiniMaxM2ForCausalLM")


@pytest.mark.megatron
def test_demo_qwen3_next_matches_real_megatron_on_the_pinned_release():
    """`megarefit demo --config Qwen3-Next-80B-A3B-Thinking.json --tp 2` on the installed release (the pinned
    0.16.1 ships GatedDeltaNet too): Megatron-Core's GatedDeltaNet and gated attention, zero-centered norms, a
    gated shared expert; transformers' Qwen3NextForCausalLM gives the same logits after the refit. On 0.19.2
    test_megatron_0_19.py runs the same demo (with Qwen3.5's)."""
    pytest.importorskip("megatron.core")
    from megarefit.demo.megatron_cpu import megatron_series

    if megatron_series() >= (0, 19):
        pytest.skip("test_megatron_0_19.py runs this demo on 0.19.2")
    _demo_says("Qwen3-Next-80B-A3B-Thinking.json", "Qwen3NextForCausalLM", layout=("--tp", "2"))
