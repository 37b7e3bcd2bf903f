"""Multi-token-prediction layers against real Megatron-Core models on CPU.

DeepSeek-V3-style (MLA + MoE) and GLM-4.5-style models built with one MTP layer
(``mtp_num_layers=1``) at TP=2 and PP=2 (two gloo processes): every rank's
parameter names and shapes equal what megarefit's layout places there (incl. the
last stage's kept-in-sync embedding copy at PP=2), the classifier agrees with the
table, and the shards round-trip exactly to HF (MTP layer i = HF layer
``num_layers + i``, as DeepSeek-V3 / GLM-4.5 checkpoints store it). Megatron's MTP
forward needs labels and transformers ignores MTP layers, so this is a layout check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

import megarefit  # noqa: E402
from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.specs.megatron_core import REFERENCE, MegatronCore  # noqa: E402
from megarefit.layout.geometry import source_tensors  # noqa: E402
from megarefit.layout.megatron_model import check_stated  # noqa: E402
from megatron_jobs import mtp_layout_job  # noqa: E402
from test_megatron_mla_glm import _config  # noqa: E402

pytestmark = pytest.mark.megatron
LAYOUTS = [(2, 1), (1, 2)]


def _configs() -> dict[str, dict]:
    out = {}
    for fam in ("deepseek", "glm"):
        cfg = _config(fam)
        cfg.update(num_nextn_predict_layers=1, num_hidden_layers=4)
        out[fam] = cfg
    return out


@pytest.fixture(scope="module")
def built():
    per_rank = run_workers(mtp_layout_job, world_size=2, args=(_configs(), LAYOUTS), timeout=900)
    return {key: {r[key]["coord"]: r[key] for r in per_rank} for key in per_rank[0]}


@pytest.mark.parametrize("fam", ["deepseek", "glm"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_mtp_layout_matches_real_megatron(built, fam, tp, pp):
    cfg = _configs()[fam]
    ranks = built[f"{fam}-tp{tp}-pp{pp}"]
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, mtp_layers=1, megatron=harness_megatron())
    want = source_tensors(dims, layout)
    assert set(ranks) == set(want)
    for coord, got in ranks.items():
        assert got["problems"] == []
        assert got["shapes"] == {n: t.shape for n, t in want[coord].items()}, coord
        [(rank, read)] = got["read"]  # what Publisher.from_megatron reads: this rank, the stated layout
        read = SourceLayout.from_dict(read)
        assert rank == coord and read.megatron.version == layout.megatron.version
        check_stated(read, dataclasses.replace(layout, megatron=read.megatron))  # raises naming a field
    last = ranks[(0, pp - 1, 0)]["shapes"]
    assert "mtp.layers.0.eh_proj.weight" in last and last["mtp.layers.0.eh_proj.weight"] == (64 // tp, 128)
    assert "embedding.word_embeddings.weight" in last  # PP=2: the MTP block keeps its own synced copy


@pytest.mark.parametrize("fam", ["deepseek", "glm"])
@pytest.mark.parametrize("version,inner", [("0.16.1", "transformer_layer"), ("0.19.2", "mtp_model_layer")])
def test_mtp_shards_round_trip(fam, version, inner):
    """Random HF tensors (layer num_layers = the MTP layer) -> Megatron shards with an MTP
    layer -> HF, bit-exact, at tp=2 pp=2 ep=2 and both layer specs, under the MTP layer's name in
    megatron-core 0.16 (``transformer_layer``) and 0.17+ (``mtp_model_layer``)."""
    from megarefit.planner import plan_hf_to_megatron

    cfg = _configs()[fam]
    dims = ModelDims.from_hf_config(cfg)
    megatron = MegatronCore.verified(version)
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers,
                                mtp_layers=1)
    g = torch.Generator().manual_seed(1)
    hf = {r.name: torch.randn(m.shape, generator=g) for r, m in plan_hf_to_megatron(dims, layout, "float32").sources.items()}
    assert f"model.layers.{dims.num_layers}.eh_proj.weight" in hf
    for spec in ("local", "te"):
        shards = megarefit.hf_to_megatron(hf, cfg, tp=2, pp=2, ep=2, layer_spec=spec, mtp_layers=1, megatron=megatron)
        mtp = {n.split(".")[3] for n in shards[(0, 1, 0)] if n.startswith("mtp.layers.0.") and n.count(".") > 4}
        assert mtp == {inner}, mtp
        back = megarefit.megatron_to_hf(shards, cfg, tp=2, pp=2, ep=2, megatron=megatron)
        assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    with pytest.raises(megarefit.errors.UnexpectedParameterError, match="pass mtp_layers=1"):
        megarefit.hf_to_megatron(hf, cfg, megatron=megatron)
