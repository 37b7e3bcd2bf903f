"""Cutting a plan into streamed groups (:func:`megarefit.online.receiver.stream.stream_groups`), as a property.

For any plan and ring size that holds its largest layer: the groups cover the plan's targets
exactly once and in plan order, never split a layer, each lies inside the ring, consecutive
groups share no ring byte unless one of them is a single layer larger than half the ring, and
each group's views tile its bytes without overlap. Checked against a direct count of the
plan's targets (names parsed here, not with the module's own layer parser).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import case_config

from megarefit import ModelDims, SourceLayout, plan_megatron_to_hf
from megarefit.online.receiver.stream import ALIGN, MemoryBudgetError, budget_for, default_memory_budget, stream_groups
from megarefit.targets import VllmTarget, plan_megatron_to_vllm


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[parts.index("layers") + 1] if "layers" in parts else "-"


def _bytes(plan, ref) -> int:
    meta = plan.targets[ref]
    return -(-meta.numel * {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}[meta.dtype] // ALIGN) * ALIGN


@st.composite
def plans(draw):
    if draw(st.booleans()):
        cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": draw(st.integers(1, 40)) * 8,
               "num_hidden_layers": draw(st.integers(1, 6)), "vocab_size": draw(st.integers(8, 3000)),
               "tie_word_embeddings": draw(st.booleans())}
    else:
        cfg = case_config(draw(st.sampled_from(["qwen3_moe", "deepseek_v3"])))
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    if draw(st.booleans()):
        return plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(2, draw(st.integers(0, 1))))
    return plan_megatron_to_hf(dims, layout)


@settings(max_examples=80, deadline=None)
@given(plans(), st.floats(1.0, 12.0))
def test_groups_cover_whole_layers_once_in_the_ring(plan, scale):
    runs: dict[str, int] = {}
    for ref in plan.targets:
        runs[_layer(ref.name)] = runs.get(_layer(ref.name), 0) + _bytes(plan, ref)
    largest = max(runs.values())
    ring = int(largest * scale) // ALIGN * ALIGN
    groups = stream_groups(plan, ring)
    assert [r for g in groups for r in g.plan.targets] == list(plan.targets)  # once each, in order
    group_of: dict[str, set[int]] = {}
    for k, g in enumerate(groups):
        for r in g.plan.targets:
            group_of.setdefault(_layer(r.name), set()).add(k)
        assert 0 <= g.start and g.start + g.nbytes <= ring
        spans = sorted((g.offsets[r], g.offsets[r] + _bytes(plan, r)) for r in g.plan.targets)
        assert spans[0][0] == g.start and spans[-1][1] == g.start + g.nbytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # tiled, no overlap
        if k and groups[k - 1].overlaps(g):  # only a layer larger than half the ring may overlap its neighbour
            assert max(g.nbytes, groups[k - 1].nbytes) > ring // 2
    assert all(len(ks) == 1 for layer, ks in group_of.items() if layer != "-"), "a layer split across groups"
    assert len(groups) == 1 or all(g.nbytes <= ring // 2 or len({_layer(r.name) for r in g.plan.targets}) == 1
                                   for g in groups)


def test_a_ring_below_the_largest_layer_names_it():
    dims = ModelDims.from_hf_config(case_config("qwen3_moe"))
    plan = plan_megatron_to_hf(dims, SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1),
                                                        num_layers=dims.num_layers))
    with pytest.raises(MemoryBudgetError, match=r"more than the ring of 1024 bytes") as err:
        stream_groups(plan, 1024)
    need = err.value.ring_bytes_needed
    assert stream_groups(plan, need)  # exactly the named size fits
    assert budget_for(need) * 7 // 8 >= need and default_memory_budget(plan) >= budget_for(need)


def test_layer_names_parsed_here_agree_with_the_plan():
    dims = ModelDims.from_hf_config(case_config("qwen3_moe"))
    plan = plan_megatron_to_hf(dims, SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1),
                                                        num_layers=dims.num_layers))
    assert {_layer(r.name) for r in plan.targets} >= {"0", "1", "-"}
    assert all(re.fullmatch(r"\d+|-", _layer(r.name)) for r in plan.targets)
