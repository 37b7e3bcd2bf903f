"""The Megatron-Core release table and trainer records (megarefit.specs.megatron_core) as data:
each release states one fact of every pair that differs between releases, records round-trip,
and what megarefit has not verified is refused with the fix named."""

from __future__ import annotations

import pytest

from megarefit import ModelDims, SourceLayout, plan_megatron_to_hf
from megarefit.errors import UnverifiedMegatronError
from megarefit.specs.megatron_core import RELEASES, VERIFIED_VERSIONS, MegatronCore, release_of
from megarefit.specs.table import Condition as C

PAIRS = [(C.MTP_TRANSFORMER_LAYER, C.MTP_MODEL_LAYER), (C.DSA_ROPE_LAST, C.DSA_ROPE_FIRST),
         (C.MAMBA_CONV_MODULE, C.MAMBA_CONV_PARAMS)]
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
       "vocab_size": 256}


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.series)
def test_every_release_states_one_fact_of_each_pair(release):
    for pair in PAIRS:
        assert len(set(pair) & release.facts) == 1, (release.series, pair)
    assert all(v.startswith(release.series + ".") for v in release.verified)
    assert len({f.name for f in release.flags}) == len(release.flags)


def test_local_version_labels_are_read_as_the_release():
    assert release_of("0.19.2+b0df788").series == "0.19"
    with pytest.raises(UnverifiedMegatronError, match=r"0\.19\.3 is not a version .* verified: \['0\.16\.1'"):
        release_of("0.19.3")


@pytest.mark.parametrize("version", VERIFIED_VERSIONS)
def test_records_round_trip_and_plan(version):
    record = MegatronCore.verified(version)
    assert MegatronCore.from_dict(record.to_dict()) == record
    dims = ModelDims.from_hf_config(MOE)
    layout = SourceLayout.build(tp=1, pp=1, ep=2, padded_vocab_size=256, num_layers=2, megatron=record)
    assert SourceLayout.from_dict(layout.to_dict()) == layout
    assert plan_megatron_to_hf(dims, layout).summary()["total"]["ops"] > 0


def test_what_is_not_verified_is_refused_naming_the_fix():
    dims = ModelDims.from_hf_config(MOE)
    layout = SourceLayout.build(tp=1, pp=1, ep=2, padded_vocab_size=256, num_layers=2)
    unread = MegatronCore("0.19.2", None)
    with pytest.raises(UnverifiedMegatronError, match="were not read; pass megatron=megatron_core_of"):
        plan_megatron_to_hf(dims, layout.with_megatron(unread))
    flags = dict(MegatronCore.verified("0.18.2", dims.megatron_needs()).flags) | {"moe_mlp_glu_interleave_size": 128}
    with pytest.raises(UnverifiedMegatronError, match="moe_mlp_glu_interleave_size=128 is refused"):
        plan_megatron_to_hf(dims, layout.with_megatron(MegatronCore("0.18.2", tuple(flags.items()))))
    assumed = MegatronCore("0.19.3", MegatronCore.verified("0.19.2", dims.megatron_needs()).flags, assume="0.19.2")
    assert plan_megatron_to_hf(dims, layout.with_megatron(assumed)).layout.megatron.version == "0.19.3"
    with pytest.raises(UnverifiedMegatronError, match="GroupedMLP .* removed in megatron-core 0.17"):
        plan_megatron_to_hf(dims, SourceLayout.build(tp=1, pp=1, ep=2, padded_vocab_size=256, num_layers=2,
                                                     expert_layout="legacy_grouped",
                                                     megatron=MegatronCore.verified("0.17.1")))
