"""MTP draft models: Megatron's MTP layers planned into vLLM's speculative-decoding drafters.

The oracle is vLLM itself: its MTP model classes (``Glm4MoeMTP`` for GLM-4.5,
``DeepSeekMTP`` for DeepSeek-V3 with MLA), built as vLLM's proposer builds them
(``SpeculativeConfig(method="mtp")``, ``initialize_model`` with the draft model
config) in two real tensor-parallel processes on CPU (gloo), with expert parallelism
off and on, filled by their own ``load_weights`` from full HF tensors: transformers'
``save_pretrained`` names for the decoder plus MTP layer ``model.layers.{N}`` (enorm,
hnorm, eh_proj, shared_head.norm and a decoder layer's tensors), as DeepSeek-V3 /
GLM-4.5 checkpoints store it. Megatron shards with one MTP layer (megarefit's import,
checked against real Megatron-Core MTP models in test_megatron_mtp.py) are planned for
each vLLM rank's draft model (``VllmTarget(draft=True)``): every drafter parameter
comes out bit-identical under vLLM's name and local shape, and the ones megarefit
leaves out are exactly the embedding and head vLLM shares with the target model. The
full-tensor path (``plan_megatron_to_hf(part="draft")``, what a draft receiver pulls)
holds exactly the MTP layer's tensors, and a drafter loaded from them alone equals one
loaded from the whole checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import megarefit  # noqa: E402
from megarefit import ModelDims, RankCoord, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.errors import LayoutError  # noqa: E402
from megarefit.planner import plan_megatron_to_hf  # noqa: E402
from megarefit.targets import VllmTarget, plan_megatron_to_vllm, vllm_params  # noqa: E402
from megarefit.transport import LocalTransport  # noqa: E402
from megarefit.transport.execute import run_refit_cycle  # noqa: E402
from moe_cases import case_config  # noqa: E402
from reference import hf_checkpoint_state, with_mtp_layer  # noqa: E402
from vllm_helpers import same_generation  # noqa: E402
from vllm_loader_jobs import unportable, vllm_draft_job  # noqa: E402

FAMILIES = ["glm4_moe", "deepseek_v3"]
SHARED = ("model.embed_tokens.weight", "shared_head.head.weight")  # the target's, in a running engine
# trainer layouts (tp, ep, etp, expert layout, layer spec); one MTP layer on the last stage
TRAINERS = [(2, 2, 1, "te_grouped", "te"), (2, 1, 2, "sequential", "local")]


def _layout(dims: ModelDims, tp: int, ep: int, etp: int, expert_layout: str, layer_spec: str,
            mtp_layers: int = 1) -> SourceLayout:
    return SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                              num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout,
                              mtp_layers=mtp_layers)


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        cfg = case_config(family) | {"num_nextn_predict_layers": 1}
        hf = with_mtp_layer(cfg, hf_checkpoint_state(cfg, tmp_path_factory.mktemp(family)))
        dims = ModelDims.from_hf_config(cfg)
        shards = megarefit.hf_to_megatron(hf, cfg, tp=2, ep=1, etp=2, mtp_layers=1)
        layout = _layout(dims, 2, 1, 2, "sequential", "local")
        draft_part = dict(run_refit_cycle(plan_megatron_to_hf(dims, layout, "float32", part="draft"),
                                          LocalTransport({RankCoord(*r): s for r, s in shards.items()})))
        out[family] = (cfg, hf, {n: t.clone() for n, t in draft_part.items()})
    return out


@pytest.fixture(scope="module")
def drafters(states, tmp_path_factory):
    """Per (family, expert_parallel), per vLLM rank: the drafter loaded from the whole HF
    checkpoint, then one loaded from the draft part alone."""
    cases = {f"{family}-ep{int(ep)}": (cfg, [hf, part], ep) for family, (cfg, hf, part) in states.items()
             for ep in (False, True)}
    per_rank = run_workers(vllm_draft_job,
                           start_method="spawn", world_size=2, args=(cases, str(tmp_path_factory.mktemp("vllm"))),
                           timeout=600)
    return {key: [[({n: unportable(t) for n, t in params.items()}, maps, cls) for params, maps, cls in
                   per_rank[rank][key]] for rank in range(2)] for key in cases}


def test_draft_part_is_the_mtp_layers(states):
    """What a full-tensor draft receiver pulls: exactly the HF tensors of MTP layer N
    (no embedding or head copies), and the model part is everything else."""
    for family, (cfg, hf, part) in states.items():
        n = cfg["num_hidden_layers"]
        assert set(part) == {k for k in hf if k.startswith(f"model.layers.{n}.")}, family
        for name, tensor in part.items():
            assert torch.equal(tensor, hf[name]), name
        dims = ModelDims.from_hf_config(cfg)
        model = plan_megatron_to_hf(dims, _layout(dims, 2, 1, 2, "sequential", "local"), "float32", part="model")
        assert {r.name for r in model.targets} == set(hf) - set(part), family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_draft_plan_matches_vllm_drafters(states, drafters, family, expert_parallel):
    cfg, hf, _ = states[family]
    dims = ModelDims.from_hf_config(cfg)
    for tp, ep, etp, expert_layout, layer_spec in TRAINERS:
        shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, layer_spec=layer_spec,
                                          expert_layout=expert_layout, mtp_layers=1)
        layout = _layout(dims, tp, ep, etp, expert_layout, layer_spec)
        transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
        for rank in range(2):
            (want, maps, cls), _ = drafters[f"{family}-ep{int(expert_parallel)}"][rank]
            assert cls == {"glm4_moe": "Glm4MoeMTP", "deepseek_v3": "DeepSeekMTP"}[family]
            expert_map = next(iter(maps.values())) if expert_parallel else None
            target = VllmTarget(2, rank, expert_parallel=expert_parallel, expert_map=expert_map, draft=True)
            plan = plan_megatron_to_vllm(dims, layout, "float32", target)
            got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
            where = f"{family} trainer tp={tp} ep={ep} etp={etp} {expert_layout}/{layer_spec}, vLLM rank {rank}"
            assert sorted(set(want) - set(got)) == sorted(n for n in want if n.endswith(SHARED)), where
            assert set(got) <= set(want), where
            for name, tensor in got.items():
                assert tensor.shape == want[name].shape, (name, where)
                assert torch.equal(tensor, want[name]), (name, where)
            assert plan.nbytes < 0.5 * sum(t.numel() * t.element_size() for t in hf.values()), where


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_part_loads_the_drafter(drafters, family):
    """A drafter's own ``load_weights`` from the draft part alone gives every parameter it
    gets from the whole checkpoint, but the embedding and head (the target's, in an engine)."""
    for rank in range(2):
        (whole, _, _), (part, _, _) = drafters[f"{family}-ep0"][rank]
        for name, tensor in whole.items():
            if not name.endswith(SHARED):
                assert torch.equal(part[name], tensor), (name, rank)


def test_draft_targets_refuse_what_they_cannot_refit(states):
    cfg, _, _ = states["glm4_moe"]
    dims = ModelDims.from_hf_config(cfg)
    with pytest.raises(LayoutError, match=r"draft model has 1 layer\(s\).*trainers publish 0.*mtp_num_layers=1"):
        plan_megatron_to_vllm(dims, _layout(dims, 2, 1, 2, "sequential", "local", mtp_layers=0), "float32",
                              VllmTarget(2, 0, draft=True))
    no_mtp = ModelDims.from_hf_config(cfg | {"num_nextn_predict_layers": 0})
    with pytest.raises(LayoutError, match="no MTP layers"):
        vllm_params(no_mtp, VllmTarget(2, 0, draft=True))
    with pytest.raises(LayoutError, match="no MTP layers"):
        plan_megatron_to_hf(no_mtp, _layout(no_mtp, 2, 1, 2, "sequential", "local", 0), "float32", part="draft")


def test_draft_refit_in_a_speculative_decoding_engine(tmp_path):
    """A real vLLM engine (CPU) serving GLM-4.5 with MTP speculative decoding, refitted through
    the weight-transfer API from two trainer ranks (tp=2, one MTP layer) over NIXL
    (tests/vllm_draft_scenario.py): version 1 as full HF tensors, version 2 sharded. After each
    target update the drafter still holds the previous version (vLLM updates the two models
    separately); after ``start_draft_weight_update`` -> ``update_weights`` -> ``finish`` its
    MTP-only parameters hold exactly that version's bytes, its embedding is still the target's
    (shared, untouched by the draft update), greedy generation with speculative decoding equals
    HF transformers' from that version, draft tokens were proposed, and the trainers'
    ``wait_receivers`` returns once the target and the draft receiver acknowledged."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("nixl")
    script = Path(__file__).with_name("vllm_draft_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["drafter"] == "Glm4MoeMTP"
    stages = result["stages"]
    holds = {name: stage["draft_holds"] for name, stage in stages.items()}
    assert holds == {"initial": [0] * 4, "v1-target": [0] * 4, "v1-draft": [1] * 4, "v2-target": [1] * 4,
                     "v2-draft": [2] * 4}, holds
    for name, stage in stages.items():
        assert stage["embedding_shared"], name
        assert same_generation(stage["vllm"], stage["hf"]), (name, stage)
    assert stages["v2-draft"]["vllm"] != stages["initial"]["vllm"]
    assert result["v1-draft-report"]["target"] is None and "draft=True" in result["v2-draft-report"]["target"]
    assert result["draft_tokens"] > 0, "speculative decoding must have run"
    assert result["acks"] == ["acked", "acked", "dropped", "dropped"], result["acks"]


@pytest.mark.skipif(not os.environ.get("MEGAREFIT_SLOW_TESTS"), reason="a second vLLM server start (~1 min on 2 "
                    "cores); the draft lifecycle is in CI above; set MEGAREFIT_SLOW_TESTS=1 to run it")
def test_draft_refit_over_http(tmp_path):
    """The same GLM-4.5 + MTP model behind vLLM's OpenAI server with ``--speculative-config``:
    ``VllmHttpRefit.refit(1, draft=True, sharded)`` runs ``/pause`` -> the target update -> the
    draft update -> ``/resume``; greedy ``/v1/completions`` equal HF transformers' from version
    1, ``/weight_info`` says 1, and the trainers' ``wait_receivers`` sees two receivers (the
    worker's target and draft) acknowledge."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("nixl")
    script = Path(__file__).with_name("vllm_draft_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "http"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == "1" and result["acks"] == ["acked", "acked"], result
    assert same_generation(result["vllm"], result["hf"]), result
