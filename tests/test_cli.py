"""The command line: `megarefit plan` on real full-size configs, `megarefit demo` end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import CONFIG_DIR
from megarefit import Plan
from megarefit.cli import main


def test_plan_llama_405b_tp8_pp16(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--config", str(CONFIG_DIR / "Llama-3.1-405B.json"), "--tp", "8", "--pp", "16",
               "--first-stage-layers", "7", "--last-stage-layers", "7", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "7325 ops" in text and "validated exact cover" in text and "811.71 GB" in text
    plan = Plan.from_json(out.read_text())  # re-validates
    assert plan.layout.stage_layers == (7,) + (8,) * 14 + (7,)


def test_plan_reports_bad_layout_clearly(capsys):
    rc = main(["plan", "--config", str(CONFIG_DIR / "Llama-3.1-405B.json"), "--tp", "8", "--pp", "16"])
    assert rc == 2
    assert "first_stage_layers=7" in capsys.readouterr().out
    rc = main(["plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"), "--tp", "16"])
    assert rc == 2
    assert "num_query_groups=8 not divisible by tp=16" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-8B", "Llama-3.1-8B", "Llama-3.1-70B", "Mistral-7B-v0.3",
                                  "Qwen2.5-0.5B"])
def test_plan_every_dense_config(name, capsys):
    cfg = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    tp = 2
    pp = 2 if cfg["num_hidden_layers"] % 2 == 0 else 1
    assert main(["plan", "--config", str(CONFIG_DIR / f"{name}.json"), "--tp", str(tp), "--pp", str(pp),
                 "--per-rank"]) == 0
    assert "validated exact cover" in capsys.readouterr().out


@pytest.mark.megatron
def test_demo_passes():
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "max |HF logits - Megatron logits|" in proc.stdout


@pytest.mark.megatron
def test_live_demo_over_nixl_passes():
    pytest.importorskip("nixl")
    pytest.importorskip("megatron.core")
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--transport", "nixl", "--engine", "hf",
                           "--versions", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "v2 (warm)" in proc.stdout and "PASS" in proc.stdout


def test_vllm_engine_needs_nixl(capsys):
    assert main(["demo", "--engine", "vllm"]) == 2
    assert "--engine vllm needs --transport nixl" in capsys.readouterr().out


@pytest.mark.parametrize("name, args", [
    ("DeepSeek-V3", ["--tp", "8", "--pp", "16", "--ep", "64", "--etp", "1", "--first-stage-layers", "4",
                     "--last-stage-layers", "1"]),
    ("Qwen3-235B-A22B", ["--tp", "4", "--pp", "16", "--ep", "64", "--first-stage-layers", "5",
                         "--last-stage-layers", "5"]),
    ("Mixtral-8x7B-v0.1", ["--tp", "8", "--pp", "16", "--ep", "8"]),
    ("GLM-4.5-Air", ["--tp", "4", "--pp", "2", "--ep", "16", "--etp", "1", "--layer-spec", "local"]),
])
def test_plan_full_size_moe(name, args, capsys):
    t0 = __import__("time").perf_counter()
    assert main(["plan", "--config", str(CONFIG_DIR / f"{name}.json"), *args, "--no-execute-meta"]) == 0
    out = capsys.readouterr().out
    assert "validated exact cover" in out and "experts" in out
    assert __import__("time").perf_counter() - t0 < 120  # seconds on a 2-core CPU: ~2-8 s
