"""The columnar export planner against the per-object planner it replaced
(tests/reference_planner.py): same sources, targets and ops (as sets), over random
dense and MoE models, trainer layouts and receiver expert sets; plus the tables' own
contracts (single rows == the materialized mapping, ops grouped by target)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from conftest import real_config
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st
from moe_cases import moe_config
from reference_planner import reference_megatron_to_hf
from test_plan import dims_and_layout

from megarefit import ModelDims, SourceLayout
from megarefit.errors import LayoutError
from megarefit.plan.table import OpTable, TensorTable
from megarefit.planner.megatron_to_hf import plan_export
from megarefit.quant.fp8 import UnsupportedQuantizationError


def assert_same_plan(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                     experts: frozenset[int] | None = None) -> None:
    ref = reference_megatron_to_hf(dims, layout, dtype, experts)
    new = plan_export(dims, layout, dtype, experts)
    assert isinstance(new.ops, OpTable) and isinstance(new.sources, TensorTable)
    assert dict(new.sources) == dict(ref.sources)
    assert dict(new.targets) == dict(ref.targets)
    assert Counter(new.ops) == Counter(ref.ops)
    assert len(new.ops) == len(ref.ops)
    # grouped by target, targets in the table's order, ascending target offset within one
    position = {t: i for i, t in enumerate(new.targets)}
    keys = [(position[op.dst], op.dst_offset) for op in new.ops]
    assert keys == sorted(keys)
    assert new.summary() == ref.summary()
    assert new.nbytes == ref.nbytes


def dense_case():
    """test_plan.py's dense models and layouts (Llama / Qwen2 / Qwen3, tp, pp, vocab padding,
    biases, tied embeddings, both layer specs), with no expert set."""
    return dims_and_layout().map(lambda case: (*case, None))


@st.composite
def moe_case(draw):
    name = draw(st.sampled_from(["Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "DeepSeek-V3", "GLM-4.5-Air", "GLM-5",
                                 "gpt-oss-120b"]))
    tp, ep = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    etp = draw(st.sampled_from([1, tp]))
    n_exp = ep * draw(st.integers(1, 3))
    extra = {"num_hidden_layers": pp * draw(st.integers(1, 2))}
    extra |= {"num_experts": n_exp} if name == "Qwen3-30B-A3B" else (
        {"num_local_experts": n_exp} if name in ("Mixtral-8x7B-v0.1", "gpt-oss-120b") else {"n_routed_experts": n_exp})
    if name == "gpt-oss-120b":
        extra["layer_types"] = ["full_attention"] * extra["num_hidden_layers"]
    mtp = 0
    if name in ("DeepSeek-V3", "GLM-4.5-Air", "GLM-5") and draw(st.booleans()):
        mtp = 1
        extra["num_nextn_predict_layers"] = 1
    if name != "Mixtral-8x7B-v0.1":
        extra["num_key_value_heads"] = 4  # divisible by every tp drawn
    if name == "gpt-oss-120b":
        etp = 1  # Megatron-Core: biased experts only at etp 1
    dims = ModelDims.from_hf_config(moe_config(name, **extra))
    try:
        layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers, mtp_layers=mtp,
                                    expert_layout=draw(st.sampled_from(["sequential", "te_grouped", "legacy_grouped"])),
                                    layer_spec=draw(st.sampled_from(["local", "te"])))
        dims.check_layout(tp, pp, ep, etp)
        dims.check_expert_layout(layout.expert_layout)
    except LayoutError:
        reject()  # a layout Megatron-Core cannot build: not a draw
    experts = draw(st.none() | st.frozensets(st.integers(0, n_exp - 1)))
    return dims, layout, experts


@settings(max_examples=60, deadline=None)
@given(dense_case(), st.sampled_from(["bfloat16", "float32"]))
def test_dense_plans_match_the_reference(case, dtype):
    dims, layout, experts = case
    assert_same_plan(dims, layout, dtype, experts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(moe_case())
def test_moe_plans_match_the_reference(case):
    assert_same_plan(*case[:2], "bfloat16", case[2])


def test_real_deepseek_v3_matches_the_reference():
    """All 61 layers, 256 experts, MTP, DeepSeek's bf16-only tensors: tp 2, ep 4, pp 1."""
    dims = ModelDims.from_hf_config(real_config("DeepSeek-V3"))
    layout = SourceLayout.build(tp=2, pp=1, ep=4, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, expert_layout="te_grouped", mtp_layers=1)
    assert_same_plan(dims, layout, experts=frozenset(range(0, 256, 5)))


def test_single_rows_agree_with_the_materialized_tables():
    dims = ModelDims.from_hf_config(moe_config("Qwen3-30B-A3B", num_hidden_layers=2))
    layout = SourceLayout.build(tp=2, pp=2, ep=2, padded_vocab_size=dims.padded_vocab_size(2), num_layers=2)
    plan = plan_export(dims, layout)
    for table in (plan.sources, plan.targets):
        refs = list(table)
        assert len(refs) == len(table)
        for i in (0, len(refs) // 2, len(refs) - 1):
            assert table.ref(i) == refs[i] and table.meta(i) == table[refs[i]]
    fresh = plan_export(dims, layout)  # nothing materialized yet: items are built one by one
    for i in (0, 7, len(plan.ops) - 1):
        assert fresh.ops[i] == plan.ops[i]
    assert fresh.ops == plan.ops and list(fresh.ops)[3:5] == list(plan.ops[3:5])


def test_first_layer_targets_come_before_later_layers():
    dims = ModelDims.from_hf_config(moe_config("Qwen3-30B-A3B", num_hidden_layers=4))
    layout = SourceLayout.build(tp=1, pp=2, ep=2, padded_vocab_size=dims.padded_vocab_size(1), num_layers=4)
    names = [t.name for t in plan_export(dims, layout).targets]
    assert names[0] == "model.embed_tokens.weight"
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # expert ep rank 1's experts right after ep rank 0's
        experts = [int(n.split(".")[5]) for n in names if n.startswith("model.layers.1.mlp.experts.") and proj in n]
        assert experts == list(range(dims.num_experts))


def assert_same_fp8_plan(dims: ModelDims, layout: SourceLayout, fmt, experts: frozenset[int] | None = None) -> None:
    from megarefit.quant.planning import _plan_fp8_ops, plan_fp8

    ref = _plan_fp8_ops(reference_megatron_to_hf(dims, layout, "bfloat16", experts), fmt)
    new = plan_fp8(plan_export(dims, layout, "bfloat16", experts), fmt)
    assert isinstance(new.ops, OpTable)
    assert list(new.sources.items()) == list(ref.sources.items()) or dict(new.sources) == dict(ref.sources)
    assert dict(new.targets) == dict(ref.targets)
    assert Counter(new.ops) == Counter(ref.ops)
    assert {q.weight: q for q in new.quantize} == {q.weight: q for q in ref.quantize}  # reasons included
    assert new.nbytes == ref.nbytes and new.summary() == ref.summary()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(dense_case(), moe_case()), st.sampled_from([(128, 128), (4, 4), (8, 16), (3, 5)]), st.booleans())
def test_fp8_plans_match_the_reference(case, block, ue8m0):
    """Blocks from the real 128x128 (nothing fits a tiny model: all receiver-side) to ones
    that split shards every way (some trainer-, some receiver-quantized, the fix point)."""
    from megarefit.quant import Fp8Format

    if case[0].family == "gpt_oss":  # vLLM serves gpt-oss in bf16 / MXFP4: block FP8 is refused
        from megarefit.quant.planning import plan_fp8

        with pytest.raises(UnsupportedQuantizationError, match="gpt_oss: block FP8 is not produced"):
            plan_fp8(plan_export(case[0], case[1], "bfloat16", case[2]), Fp8Format(block, ue8m0))
        return
    assert_same_fp8_plan(case[0], case[1], Fp8Format(block, ue8m0), case[2])


def test_real_deepseek_v3_fp8_matches_the_reference():
    from megarefit.quant import Fp8Format

    dims = ModelDims.from_hf_config(real_config("DeepSeek-V3"))
    layout = SourceLayout.build(tp=2, pp=1, ep=8, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, mtp_layers=1)
    assert_same_fp8_plan(dims, layout, Fp8Format((128, 128)), experts=frozenset(range(0, 256, 7)))


def test_fp8_mixed_plan_matches_the_reference():
    """q rows (4 per group) on the 4-row grid, k / v rows (2 per group) off it: every
    linear_qkv shard is misaligned somewhere, so q/k/v are quantized on the receiver,
    while gate/up/down (4-row, 4-column shards) are quantized on the trainers."""
    from megarefit.quant import Fp8Format
    from megarefit.quant.planning import plan_fp8, where_quantized

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 2, "intermediate_size": 8, "num_hidden_layers": 2,
           "vocab_size": 64, "tie_word_embeddings": False}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=2)
    fmt = Fp8Format((4, 4))
    assert_same_fp8_plan(dims, layout, fmt)
    where = where_quantized(plan_fp8(plan_export(dims, layout), fmt))
    assert "off the 4-row block grid" in where["model.layers.0.self_attn.q_proj.weight"]
    assert where["model.layers.1.mlp.gate_proj.weight"] == where["model.layers.1.mlp.down_proj.weight"] == "trainer"


def _reference_vllm_plan(dims, layout, target, fmt=None):
    """plan_megatron_to_vllm's steps on the per-object planners (tests/reference_planner.py)."""
    from reference_planner import reference_retarget

    from megarefit.plan import digest_of
    from megarefit.quant.planning import _plan_fp8_ops
    from megarefit.targets.vllm import worker_experts, worker_params

    hf_plan = reference_megatron_to_hf(dims, layout, "bfloat16", worker_experts(dims, target))
    if fmt is not None:
        hf_plan = _plan_fp8_ops(hf_plan, fmt)
    typed, steps, produced, _ = worker_params(dims, target, hf_plan, fmt)
    return reference_retarget(hf_plan, typed, produced, "bfloat16", steps,
                              digest_of("megatron_to_vllm", hf_plan.digest, target))


@st.composite
def vllm_case(draw):
    from megarefit.targets import VllmTarget

    if draw(st.booleans()):
        case = draw(dense_case())
    else:
        case = draw(moe_case())
        # gpt-oss's vLLM targets: vLLM's own loader and a restated one (test_vllm_moe_target.py)
        assume(case[0].family != "gpt_oss")
    dims, layout, _ = case
    tp = draw(st.sampled_from([1, 2, 4]))
    rank = draw(st.integers(0, tp - 1))
    ep = bool(dims.num_experts) and draw(st.booleans())
    return dims, layout, VllmTarget(tp, rank, expert_parallel=ep)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(vllm_case(), st.sampled_from([None, (4, 4), (8, 8)]))
def test_vllm_plans_match_the_reference(case, block):
    """One vLLM worker's plan (fused qkv / gate_up, FusedMoE slots, EP expert sets, vocab
    padding, FP8 scales and receiver staging) against the per-object re-targeting."""
    from megarefit.errors import MegarefitError
    from megarefit.quant import Fp8Format
    from megarefit.targets import plan_megatron_to_vllm

    dims, layout, target = case
    fmt = None if block is None else Fp8Format(block)
    try:
        ref = _reference_vllm_plan(dims, layout, target, fmt)
    except MegarefitError as exc:  # the worker's groups do not split this model (or FP8 off vLLM's grid):
        with pytest.raises(type(exc), match=re.escape(str(exc))):  # the planner refuses it the same way
            plan_megatron_to_vllm(dims, layout, "bfloat16", target, fmt)
        return
    new = plan_megatron_to_vllm(dims, layout, "bfloat16", target, fmt)
    assert isinstance(new.ops, OpTable)
    # the target model's plan reads no MTP layer (vLLM loads those into its draft model)
    assert dict(new.sources) == {r: m for r, m in ref.sources.items() if not r.name.startswith("mtp.layers.")}
    assert list(new.targets.items()) == list(ref.targets.items())
    assert list(new.ops) == list(ref.ops)  # same ops in the same order (merges included)
    assert new.quantize == ref.quantize and new.nbytes == ref.nbytes
    assert new.summary()["total"] == ref.summary()["total"]


def test_real_qwen3_moe_vllm_worker_matches_the_reference():
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    dims = ModelDims.from_hf_config(real_config("Qwen3-30B-A3B") | {"num_hidden_layers": 4})
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=4, expert_layout="te_grouped")
    for target in (VllmTarget(4, 1), VllmTarget(2, 1, expert_parallel=True)):
        ref = _reference_vllm_plan(dims, layout, target)
        new = plan_megatron_to_vllm(dims, layout, "bfloat16", target)
        assert list(new.targets.items()) == list(ref.targets.items()) and list(new.ops) == list(ref.ops)


def test_a_piece_of_an_unplanned_hf_tensor_is_named():
    """A vLLM parameter whose piece names an HF tensor the HF plan lacks (a spec-table /
    vLLM-layout mismatch) is refused naming the parameter and the HF tensor."""
    import pytest

    from megarefit.errors import PlanValidationError
    from megarefit.layout import Box
    from megarefit.planner.megatron_to_hf import plan_export
    from megarefit.targets.vllm_columns import retarget
    from megarefit.targets.vllm_layout import VllmParam, VllmPiece

    dims = ModelDims.from_hf_config(real_config("Qwen3-0.6B") | {"num_hidden_layers": 2})
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=2)
    hf_plan = plan_export(dims, layout)
    bogus = {"model.norm.weight": (VllmParam((4,), (VllmPiece("model.bogus.weight", Box((0,), (4,)), Box((0,), (4,))),)),
                                   None)}
    with pytest.raises(PlanValidationError, match=r"model.norm.weight.*'model.bogus.weight'"):
        retarget(hf_plan, bogus, set(), "bfloat16", [], "x")


def test_table_lookup_names_only_what_it_is_asked():
    """``TensorTable.lookup`` (used to validate quantize steps without naming every target)
    gives the same metas as the full mapping, for a GLM-5 FP8 plan's staging / weight / scale
    refs and a sample of others, and leaves out refs that are not rows."""
    import random

    from megarefit.plan import TensorRef
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.quant import Fp8Format, planning

    cfg = real_config("GLM-5") | {"num_hidden_layers": 8, "n_routed_experts": 16}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=2, ep=4, padded_vocab_size=dims.padded_vocab_size(2), num_layers=8)
    plan = planning.plan_fp8(plan_megatron_to_hf(dims, layout, "bfloat16"), Fp8Format())
    refs = [r for q in plan.quantize for r in (q.staging, q.weight, q.scale)]
    assert refs  # the rotated indexer wq_b is quantized on the receiver
    fresh = lambda t: TensorTable(t.groups, t.group, t.layer, t.expert)  # noqa: E731 - nothing named yet
    full = dict(plan.targets)
    sample = random.Random(0).sample(list(full), 60) + refs
    missing = [TensorRef(None, "model.layers.99.mlp.gate.weight"), TensorRef(None, "lm_head.weight:staging")]
    got = fresh(plan.targets).lookup(sample + missing)
    assert got == {r: full[r] for r in sample}
    src = dict(plan.sources)
    some = random.Random(1).sample(list(src), 40)
    assert fresh(plan.sources).lookup(some) == {r: src[r] for r in some}
