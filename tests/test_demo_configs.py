"""`megarefit demo` on every shipped config: accepted by the checks that run before any process
starts (and its HF model builds), or refused in one line. The full demos of several families
run in test_cli.py and test_demo_families.py; here only the cheap part runs, per config."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import CONFIG_DIR

from megarefit.cli import main

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

# tests/data/configs holds a copy of every file in the project's shared/configs (README there)
CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.json"))
# shared DSA indexers: Megatron-Core's dsa_indexer_topk_freq (0.19+); gated DeltaNet builds on every verified release
NEEDS = {"GLM-5.2-FP8.json": (0, 19)}

REFUSED = {"DeepSeek-V4-Flash.json": "no Megatron-Core release"}


def _one_line(capsys) -> list[str]:
    out = capsys.readouterr()
    return [line for line in (out.out + out.err).splitlines() if line.strip()]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_passes_the_demo_checks_and_builds_its_hf_model(name):
    """prepare_demo (shrink, layout, CPU harness, memory, transformers' model type) accepts the
    config, and transformers builds the shrunk HF model it names: Kimi-K2's `kimi_k2`, which
    transformers does not have, once ended the demo in a traceback after the trainers ran."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarefit.demo.megatron_cpu import megatron_series
    from megarefit.demo.offline import prepare_demo
    from megarefit.errors import UnsupportedModelError

    if name in REFUSED:  # no Megatron-Core release builds it (test_deepseek_v4.py checks the message)
        with pytest.raises(UnsupportedModelError, match=REFUSED[name]):
            prepare_demo(CONFIG_DIR / name)
        return
    if megatron_series() < NEEDS.get(name, (0, 0)):  # refused, naming the release it needs (passes there:
        with pytest.raises(UnsupportedModelError, match=r"megatron-core .* cannot build .* 0\.19 or later"):
            prepare_demo(CONFIG_DIR / name)  # test_megatron_0_19.py)
        return
    setup = prepare_demo(CONFIG_DIR / name)
    hf = dict(setup.hf_cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    assert type(model).__name__ == setup.cfg["architectures"][0]
    published = json.loads((CONFIG_DIR / name).read_text())
    assert setup.cfg["model_type"] == published.get("text_config", published)["model_type"]  # VL: the text model


def test_kimi_k2_builds_its_architecture_and_says_so():
    from megarefit.demo.offline import prepare_demo

    setup = prepare_demo(CONFIG_DIR / "Kimi-K2-Instruct.json")
    assert setup.cfg["model_type"] == "kimi_k2" and setup.hf_cfg["model_type"] == "deepseek_v3"
    assert any(n.startswith("HF model built as model_type deepseek_v3 (DeepseekV3ForCausalLM)") for n in setup.notes)


def test_a_model_type_transformers_cannot_build_is_one_line(capsys, monkeypatch):
    """Kimi-K2 under a transformers without its architecture (DeepseekV3ForCausalLM taken out of
    transformers' causal-LM table): one line naming both, before any process starts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, arch in list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if arch == "DeepseekV3ForCausalLM":
            monkeypatch.delitem(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type)
    assert main(["demo", "--config", str(CONFIG_DIR / "Kimi-K2-Instruct.json")]) == 2
    lines = _one_line(capsys)
    assert len(lines) == 1 and "has no model_type 'kimi_k2'" in lines[0], lines
    assert "architecture 'DeepseekV3ForCausalLM'" in lines[0] and "Traceback" not in lines[0], lines


@pytest.mark.parametrize("module", ["triton", "einops"])
def test_the_hybrid_demo_without_triton_or_einops_names_the_fix(module, capsys, monkeypatch):
    """Megatron-Core's Mamba layers import triton and einops: without one (hidden here) the
    Nemotron-H demo is one line naming `pip install <it>`, before any trainer process."""
    monkeypatch.setitem(sys.modules, module, None)
    assert main(["demo", "--config", str(CONFIG_DIR / "NVIDIA-Nemotron-3-Nano-30B-A3B.json")]) == 2
    lines = _one_line(capsys)
    assert len(lines) == 1 and f"needs {module}" in lines[0] and f"pip install {module}" in lines[0], lines


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B.json", "NVIDIA-Nemotron-3-Nano-30B-A3B.json"])
def test_the_live_demo_refuses_moe_and_hybrid_configs_in_one_line(name, capsys):
    """`demo --transport nixl` shrinks configs like the local demo, and builds dense trainers only:
    an MoE or hybrid config is one line before any process (an MoE one once failed after the
    trainers ran, at the HF install)."""
    assert main(["demo", "--transport", "nixl", "--engine", "hf", "--config", str(CONFIG_DIR / name)]) == 2
    lines = _one_line(capsys)
    assert len(lines) == 1 and "--transport nixl builds dense GPT trainers only" in lines[0], lines
