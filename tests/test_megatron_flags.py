"""The ``TransformerConfig`` flag audit on real configs of the imported megatron-core release: the pinned
0.16.1 here, 0.17.1 / 0.18.2 / 0.19.2 in the child pytests of test_megatron_0_17_0_18.py and
test_megatron_0_19.py (no child of its own).

Each family's trainer, configured as Megatron-Bridge configures it (tests/flag_audit.py, written by hand),
is planned; each audited flag changed in turn is refused, naming the flag, the value, the release and the
value to set, unless the model does not have what the flag changes or the change computes the same model
(both written out below, not read from megarefit's tables). docs/megatron-versions.md's table is checked
against the release table.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import megatron.core  # noqa: E402
from flag_audit import CASES, CONFIGS, audit, build  # noqa: E402

from megarefit import ModelDims, plan_megatron_to_hf  # noqa: E402
from megarefit.errors import UnverifiedMegatronError  # noqa: E402
from megarefit.integrations.megatron import source_layout  # noqa: E402
from megarefit.specs import FAMILIES  # noqa: E402
from megarefit.specs.megatron_core import RELEASES, MegatronCore  # noqa: E402

pytestmark = pytest.mark.megatron
DOC = Path(__file__).resolve().parent.parent / "docs" / "megatron-versions.md"
VERSION = megatron.core.__version__

SIGMOID = frozenset({"DeepSeek-V3.json", "GLM-4.5-Air.json", "GLM-5.json", "NVIDIA-Nemotron-3-Nano-30B-A3B.json",
           "MiniMax-M2.5.json"})
MOE = SIGMOID | {"Qwen3-30B-A3B.json", "Mixtral-8x7B-v0.1.json", "gpt-oss-120b.json", "Qwen3.5-397B-A17B.json",
                 "Qwen3-Next-80B-A3B-Thinking.json"}
SHARED = frozenset({"DeepSeek-V3.json", "GLM-4.5-Air.json", "GLM-5.json", "NVIDIA-Nemotron-3-Nano-30B-A3B.json",
                    "Qwen3.5-397B-A17B.json", "Qwen3-Next-80B-A3B-Thinking.json"})
# flags that matter only for models with routed experts, shared experts, MLA, a DSA indexer, MTP layers
ONLY = {**dict.fromkeys(("moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                         "moe_apply_probs_on_input", "moe_latent_size", "moe_single_grouped_weight",
                         "moe_single_grouped_bias", "moe_mlp_glu_interleave_size", "expert_gtp_weight_remat_size"),
                        MOE),
        **dict.fromkeys(("moe_shared_expert_gate", "moe_shared_expert_glu_interleave_size",
                         "use_grouped_gemm_for_shared_expert"), SHARED),
        "mla_down_proj_fusion": {"DeepSeek-V3.json", "GLM-5.json"}, "mtp_use_repeated_layer": {"DeepSeek-V3.json"},
        **dict.fromkeys(("dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu"),
                        frozenset({"GLM-5.json"}))}
# changes that build the same model: a sigmoid router renormalises its top k either way; gpt-oss's
# add_bias_linear builds linear_qkv's bias with or without add_qkv_bias; the DSA indexer's Hadamard rotation
# turns its q and k alike (orthogonal: the same scores; HF has none, Megatron-Bridge turns it off)
SAME = {(c, "moe_router_pre_softmax") for c in SIGMOID} | {("gpt-oss-120b.json", "add_qkv_bias"),
                                                           ("GLM-5.json", "dsa_indexer_rotate_activation")}


@pytest.fixture(scope="module")
def audited():
    return audit()


@pytest.mark.parametrize("case", list(CASES))
def test_a_bridge_trainer_plans_and_each_changed_flag_is_refused_by_name(audited, case):
    result = audited["cases"][case]
    assert result["right"] is None, result["right"]
    wrong = []
    for flag, (value, verdict) in result["changed"].items():
        matters = case in ONLY.get(flag, CASES.keys()) and (case, flag) not in SAME
        if not matters:
            ok = verdict is None
        else:
            ok = verdict is not None and f"{flag}={value!r} is refused" in verdict and (
                f"megatron-core {VERSION}" in verdict and (f"set {flag}=" in verdict or "no value" in verdict))
        if not ok:
            wrong.append((flag, value, matters, verdict))
    assert not wrong, wrong


def test_the_release_lists_every_audited_flag_its_config_has(audited):
    everywhere = {f.name for rel in RELEASES for f in rel.flags}
    listed, fields = set(audited["flags"]), set(audited["fields"])
    assert listed <= fields, sorted(listed - fields)  # no flag this release does not have (a typo reads nothing)
    assert everywhere & fields <= listed, sorted(everywhere & fields - listed)  # none it has left out


@pytest.mark.parametrize("case,zero_centered", [("Qwen3.5-27B.json", False),
                                                ("Qwen3-Next-80B-A3B-Thinking.json", False),
                                                ("Llama-3.1-8B.json", True), ("Qwen3-0.6B.json", True)])
def test_a_norm_convention_other_than_the_hf_models_is_refused_through_the_plan(case, zero_centered):
    """Megatron-LM's --apply-layernorm-1p (layernorm_zero_centered_gamma) on a Llama / Qwen3 trainer, or
    plain norms on a Qwen3.5 / Qwen3-Next one: every norm would be served 1 off."""
    cfg = json.loads((CONFIGS / case).read_text())
    config = build(case)
    dims = ModelDims.from_hf_config(cfg)
    layout = source_layout(cfg, megatron=MegatronCore.from_config(VERSION, config))
    assert plan_megatron_to_hf(dims, layout).summary()["total"]["ops"] > 0
    config.layernorm_zero_centered_gamma = zero_centered
    with pytest.raises(UnverifiedMegatronError, match=rf"megatron-core {re.escape(VERSION)}: "
                       rf"layernorm_zero_centered_gamma={zero_centered} is refused .* set "
                       rf"layernorm_zero_centered_gamma={not zero_centered} "):
        plan_megatron_to_hf(dims, source_layout(cfg, megatron=MegatronCore.from_config(VERSION, config)))


def test_family_tables_name_audited_flags():
    everywhere = {f.name for rel in RELEASES for f in rel.flags}
    named = {flag for fam in FAMILIES for flag, _ in fam.megatron_config}
    assert named and named <= everywhere, sorted(named - everywhere)


def test_the_docs_table_lists_each_flag_with_its_releases():
    """docs/megatron-versions.md's flag audit: one row per flag, its releases those that list it."""
    series = [rel.series for rel in RELEASES]
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and re.fullmatch(r"0\.\d+(-0\.\d+)?", cells[2]):
            first, _, last = cells[2].partition("-")
            span = series[series.index(first):series.index(last or first) + 1]
            for flag in re.findall(r"`(\w+)`", cells[0]):
                assert flag not in rows, flag
                rows[flag] = span
    want = {f.name: [rel.series for rel in RELEASES if f.name in {g.name for g in rel.flags}]
            for rel in RELEASES for f in rel.flags}
    assert rows == want


def test_records_of_a_model_round_trip_and_pass(audited):
    dims = ModelDims.from_hf_config(json.loads((CONFIGS / "Qwen3.5-397B-A17B.json").read_text()))
    record = MegatronCore.verified(VERSION, dims.megatron_needs())
    assert not record.table_flags and MegatronCore.from_dict(record.to_dict()) == record
    record.check(dims.megatron_needs(), model=dims.family)
    assert dict(record.flags)["layernorm_zero_centered_gamma"] is True
    table = MegatronCore.verified(VERSION)
    assert table.table_flags and MegatronCore.from_dict(table.to_dict()) == table
    assert dataclasses.replace(table, table_flags=False) != table
