"""Merged LoRA refit and PEFT naming against Megatron-Bridge 0.6.2, on real Megatron-Core 0.19.2 modules.

tests/bridge_lora.py runs in the Bridge environment (built as tests/test_bridge.py builds it) and
wraps a real Qwen3-style GPT with Bridge's ``LoRA`` and ``CanonicalLoRA`` at tp 2 and tp 1. For each:

* HF transformers' logits on megarefit's merged weights (``MergedLoRA`` served copies of every TP
  rank, translated by ``megatron_to_hf``) equal the Megatron LoRA model's forward logits (fp32);
* the merged HF tensors are bit-equal to Bridge's ``export_hf_weights(..., merge_adapter_weights=True)``;
* ``lora_to_peft`` of the raw adapter shards is bit-equal to Bridge's ``export_adapter_weights`` in
  PEFT's on-disk names (Bridge's ``convert_adapter_weights_to_peft_state``);
* the adapter-only refit: the layout, rank and ``alpha`` / ``dim`` that ``LoraPublisher.from_megatron``
  reads from the model, and ``plan_lora_to_peft`` of them over the adapter shards, give Bridge's PEFT
  state bit for bit;
* megarefit's classifier agrees with every adapter module's class and ``partition_dim``, and the
  local shapes are the ones :mod:`megarefit.layout.lora` gives (the splits this suite relies on,
  measured, not assumed).

tests/bridge_lora_moe.py does the merged checks on a GLM-4.5-style MoE (shared expert, SequentialMLP
experts) at (tp, ep, etp) = (2, 1, 1), (2, 2, 1), (1, 2, 1), and measures why expert-TP 2 is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bridge import _env_python, _run

pytestmark = pytest.mark.megatron
CASES = ("lora-tp2", "canonical_lora-tp2", "lora-tp1", "canonical_lora-tp1")
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _bridge_json(script: str, workdir: Path) -> dict:
    """``script`` (beside this file) run in the Bridge environment; its last stdout line, JSON."""
    proc = _run([str(_env_python()), str(Path(__file__).with_name(script)), str(workdir)], timeout=600,
                cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return _bridge_json("bridge_lora.py", tmp_path_factory.mktemp("lora"))


@pytest.mark.parametrize("case", CASES)
def test_merged_logits_equal_megatron_lora_logits(result, case):
    r = result[case]
    assert r["logits_max_abs"] > 0.5  # the adapters move the logits: a dropped merge shows
    assert r["logits_diff"] < 2e-5, r["logits_diff"]


@pytest.mark.parametrize("case", CASES)
def test_merged_bytes_equal_bridge_export(result, case):
    r = result[case]
    assert r["merged_names_differ"] == [] and r["merged_bytes_differ"] == [], r
    assert r["merged_max_abs_diff"] == 0.0


@pytest.mark.parametrize("case", CASES)
def test_lora_to_peft_equals_bridge_adapter_export(result, case):
    r = result[case]
    assert r["peft_tensors"] == 2 * 7 * 2  # A and B of 7 HF projections in 2 layers
    assert r["peft_names_differ"] == [] and r["peft_bytes_differ"] == []
    assert r["peft_config"] == {"peft_type": "LORA", "r": 8, "lora_alpha": 12, "target_modules": TARGETS}


@pytest.mark.parametrize("case", CASES)
def test_adapter_refit_plan_equals_bridge_adapter_export(result, case):
    """The adapter-only refit of a real Bridge model: what LoraPublisher.from_megatron reads (layout, rank,
    alpha / dim) and plan_lora_to_peft of it over the adapter shards give Bridge's PEFT state bit for bit."""
    r = result[case]
    assert r["planned_names_differ"] == [] and r["planned_bytes_differ"] == [], r
    tp = 2 if case.endswith("tp2") else 1
    assert [x["rank"] for x in r["lora_read"]] == [[t, 0, 0] for t in range(tp)]
    assert all(x["alpha_dim"] == [12.0, 8] and not x["replica"] for x in r["lora_read"])


@pytest.mark.parametrize("case", CASES)
def test_classifier_agrees_with_adapter_modules(result, case):
    r = result[case]
    assert [c for c in r["classified"] if c[3]] == []
    adapters = [c for c in r["classified"] if ".adapter." in c[0]]
    per_layer = 8 if case.startswith("lora") else 14
    assert len(adapters) == per_layer * 2 * (2 if case.endswith("tp2") else 1)


def test_splits_measured_at_tp2(result):
    """Bridge's ParallelLinearAdapter at tp=2, r=8 (hidden 64, q 64, ffn 96): A of a column base split
    over r, B of a row base over out, A of a row base over its input dim."""
    shapes = {n.split("layers.0.")[1]: s for n, s in result["lora-tp2"]["adapter_shapes"].items()}
    assert shapes == {
        "self_attention.linear_qkv.adapter.linear_in.weight": [4, 64],
        "self_attention.linear_qkv.adapter.linear_out.weight": [64, 8],
        "self_attention.linear_proj.adapter.linear_in.weight": [8, 32],
        "self_attention.linear_proj.adapter.linear_out.weight": [32, 8],
        "mlp.linear_fc1.adapter.linear_in.weight": [4, 64],
        "mlp.linear_fc1.adapter.linear_out.weight": [96, 8],
        "mlp.linear_fc2.adapter.linear_in.weight": [8, 48],
        "mlp.linear_fc2.adapter.linear_out.weight": [32, 8]}
    classes = {c[0].split("layers.0.")[1]: c[1] for c in result["lora-tp2"]["classified"] if ".layers.0." in c[0]}
    assert classes["self_attention.linear_proj.adapter.linear_in.weight"] == "RowParallelLinear"
    assert classes["self_attention.linear_proj.adapter.linear_out.weight"] == "ColumnParallelLinear"
    assert classes["self_attention.linear_qkv.adapter.linear_in.weight"] == "ColumnParallelLinear"


def test_refresh_gathers_only_the_split_factor(result):
    """At tp=2 a refresh receives, per layer, A of qkv and fc1 ([4, 64] each) and B of proj and fc2
    ([32, 8] each) from the other rank: (2*256 + 2*256) fp32 elements, 4 kB a layer."""
    assert result["lora-tp2"]["gathered_bytes"] == [2 * 4 * (2 * 4 * 64 + 2 * 32 * 8)] * 2
    assert result["lora-tp1"]["gathered_bytes"] == [0]


MOE_CASES = ("lora-tp2", "canonical_lora-tp2", "lora-tp2-ep2", "canonical_lora-tp1-ep2", "lora-tp1-ep2-normalized")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    return _bridge_json("bridge_lora_moe.py", tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_merged_logits_equal_megatron_lora_logits(moe, case):
    """Shared-expert and routed experts' adapters merged per expert (every EP rank's own): transformers' logits
    on the merged GLM-4.5 weights are the Megatron LoRA model's."""
    r = moe[case]
    assert r["logits_max_abs"] > 0.5 and r["logits_diff"] < 2e-5, r["logits_diff"]
    assert r["merged_names_differ"] == []


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_merged_bytes_against_bridge_export(moe, case):
    """Bit-equal to Bridge's merged export at ep = 1. At ep = 2 Bridge's export (given the SequentialMLP names its
    Qwen3.5 registry uses) merges EP rank 1's experts 2 and 3 with EP rank 0's adapters of the same local index,
    which is not what the trainer computes (the logits above match ours): exactly those tensors differ."""
    r = moe[case]
    if "ep2" not in case:
        assert r["merged_bytes_differ"] == [] and r["merged_max_abs_diff"] == 0.0, r["merged_bytes_differ"]
    else:
        assert r["merged_bytes_differ"] == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                                  for e in (2, 3) for p in ("down", "gate", "up"))
    assert r["ranks"] == ([[0, 0, 0], [1, 0, 1]] if case == "lora-tp2-ep2" else
                          [[0, 0, 0], [0, 0, 1]] if "ep2" in case else [[0, 0, 0], [1, 0, 0]])


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_classifier_agrees_with_adapter_modules(moe, case):
    r = moe[case]
    assert [c for c in r["classified"] if c[3]] == []
    experts = 4 if "ep2" not in case else 2  # local experts per rank
    # LoRA: 2 factors per wrapped linear, 4 linears in layer 0, qkv / proj / shared fc1 / fc2 and 2 per expert in
    # layer 1; CanonicalLoRA: q / k / v and gate / up apart (14 in layer 0, 8 + 6 + 6 per expert in layer 1)
    per_rank = 16 + 4 * experts if case.startswith("lora") else 28 + 6 * experts
    assert len([c for c in r["classified"] if ".adapter." in c[0]]) == 2 * per_rank


def test_moe_splits_measured_at_tp2(moe):
    """Bridge at tp = 2, etp = 1, r = 8 (hidden 64, moe_ffn 32, shared_ffn 32): the shared expert's adapters split
    over TP like the dense MLP's, a routed expert's whole (Bridge's is_expert_linear: expert-TP)."""
    shapes = {n.split("layers.1.")[1]: s for n, s in moe["lora-tp2"]["adapter_shapes"].items()}
    assert {k: v for k, v in shapes.items() if k.startswith("mlp.") and "local_experts.2" not in k
            and "local_experts.3" not in k} == {
        "mlp.experts.local_experts.0.linear_fc1.adapter.linear_in.weight": [8, 64],
        "mlp.experts.local_experts.0.linear_fc1.adapter.linear_out.weight": [64, 8],
        "mlp.experts.local_experts.0.linear_fc2.adapter.linear_in.weight": [8, 32],
        "mlp.experts.local_experts.0.linear_fc2.adapter.linear_out.weight": [64, 8],
        "mlp.shared_experts.linear_fc1.adapter.linear_in.weight": [4, 64],
        "mlp.shared_experts.linear_fc1.adapter.linear_out.weight": [32, 8],
        "mlp.shared_experts.linear_fc2.adapter.linear_in.weight": [8, 16],
        "mlp.shared_experts.linear_fc2.adapter.linear_out.weight": [32, 8]}
    normalized = moe["lora-tp1-ep2-normalized"]["adapter_shapes"]  # normalize_moe_lora: experts' r = 8 // top-k 2
    assert normalized["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.adapter.linear_out.weight"] == [64, 4]
    assert normalized["decoder.layers.1.mlp.shared_experts.linear_fc1.adapter.linear_in.weight"] == [8, 64]
    # per rank: dense A of qkv / fc1 and B of proj / fc2 (layer 0), qkv / proj / shared fc1 / fc2 (layer 1)
    assert moe["lora-tp2"]["gathered_bytes"] == [4 * 8 * 256] * 2
    assert moe["canonical_lora-tp1-ep2"]["gathered_bytes"] == [0, 0]


def test_expert_tp_refusal_rests_on_bridges_forward(moe):
    """At expert-TP 2 MergedLoRA refuses the experts' linear_fc2 adapters, and the real modules show why: summed
    over expert-TP (as the MoE dispatcher sums it), Bridge's wrapped linear_fc2 is not x (W + s B A)^T."""
    for r in moe["refused"]:
        assert "linear_fc2.adapter" in r["refusal"] and "#5634" in r["refusal"]
        assert r["fc2_gap"] > 0.1 * r["fc2_max_abs"], r
