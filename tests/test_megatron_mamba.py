"""Real Megatron-Core ``MambaModel`` (hybrid Mamba-2 / attention / MLP / MoE, Nemotron-H style) on
CPU against real HF ``transformers.NemotronHForCausalLM``.

A tiny random HF model (every norm, bias, ``A_log``, ``D``, ``dt_bias`` and the router's
score-correction bias perturbed) is converted to Megatron shards by the small independent
conversion below (plain ``torch.cat``/``chunk``, Megatron-Bridge's scheme), loaded into
:func:`megarefit.demo.megatron_mamba.build_mamba_model` in 2 gloo processes at several
(tp, ep, etp) layouts, and the forward logits must equal HF's. Each rank's parameter names
and shapes must equal what the conversion produced.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from megarefit.demo.megatron_mamba import mamba_arch_from_hf, torch_mamba_chunk_scan
from megarefit.demo.workers import run_workers
from megarefit.errors import MegarefitError

pytestmark = pytest.mark.megatron

HF_CONFIG = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
    "layers_block_type": ["linear_attention", "full_attention", "moe", "mlp"],  # "M*E-"
    "hidden_size": 64, "vocab_size": 256, "layer_norm_epsilon": 1e-5,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4,
    "chunk_size": 4, "time_step_min": 1e-9,  # HF clamps softplus(dt) to >= time_step_min; Megatron does not
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 80, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False,
    "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
}
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
LAYOUTS = [(2, 2, 1)]  # (tp, ep, etp) on 2 ranks, pp=1; also passes at (1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 1, 2)


# --------------------------------------------------------------------------- HF model
def tiny_hf_model() -> torch.nn.Module:
    """The tiny fp32 NemotronH of :data:`HF_CONFIG` with random weights (nothing at its init value)."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**HF_CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 8.0).log())
            elif p.dim() == 1:  # norms, D, dt_bias, conv1d.bias
                p.copy_((1.0 if "norm" in name or name.endswith(".D") else 0.0) + 0.3 * torch.randn_like(p))
            else:  # [out, in], [E, out, in], conv1d [C, 1, K]
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


# --------------------------------------------------------------------------- independent conversion
def _part(t: torch.Tensor, n: int, r: int, dim: int = 0) -> torch.Tensor:
    """Chunk ``r`` of ``n`` equal contiguous chunks of ``t`` along ``dim``."""
    return t.chunk(n, dim)[r].clone()


def mamba_mixer_shard(hf: dict, tp: int, r: int, cfg: dict) -> dict:
    """Megatron ``mixer.*`` of TP rank ``r`` from HF mixer tensors ``hf`` (names without prefix).

    HF ``in_proj`` ``[z(I); x(I); B(GN); C(GN); dt(h)]`` -> ``[z_r; x_r; B_r; C_r; dt_r]``;
    HF ``conv1d`` ``[x; B; C]`` -> ``[x_r; B_r; C_r]``; ``A_log, D, dt_bias, norm`` chunked;
    ``out_proj`` ``[H, I]`` column-chunked.
    """
    inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    gn = cfg["n_groups"] * cfg["ssm_state_size"]
    z, x, b, c, dt = hf["in_proj.weight"].split([inner, inner, gn, gn, cfg["mamba_num_heads"]])
    out = {"in_proj.weight": torch.cat([_part(t, tp, r) for t in (z, x, b, c, dt)])}
    for key in ("conv1d.weight", "conv1d.bias"):
        out[key] = torch.cat([_part(t, tp, r) for t in hf[key].split([inner, gn, gn])])
    for key in ("A_log", "D", "dt_bias", "norm.weight"):
        out[key] = _part(hf[key], tp, r)
    out["out_proj.weight"] = _part(hf["out_proj.weight"], tp, r, 1)
    return out


def qkv_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, tp: int, r: int) -> torch.Tensor:
    """Megatron ``linear_qkv.weight`` of TP rank ``r``: ``[q_g; k_g; v_g]`` per query group, chunked."""
    per_group = [torch.cat(parts) for parts in zip(q.chunk(groups), k.chunk(groups), v.chunk(groups))]
    return _part(torch.cat(per_group), tp, r)


def expert_shards(hf: dict, prefix: str, ep: int, ep_r: int, etp: int, etp_r: int) -> dict:
    """Megatron ``local_experts.{e}`` of EP rank ``ep_r`` (global experts ``ep_r*E/ep ...``),
    expert-TP rank ``etp_r``: ``fc1`` rows / ``fc2`` columns chunked over ``etp``."""
    up, down = hf[f"{prefix}experts.up_proj"], hf[f"{prefix}experts.down_proj"]  # [E, I, H], [E, H, I]
    local = up.shape[0] // ep
    out = {}
    for e in range(local):
        g = ep_r * local + e
        out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = _part(up[g], etp, etp_r)
        out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = _part(down[g], etp, etp_r, 1)
    return out


def layer_shard(hf_sd: dict, i: int, kind: str, cfg: dict, rank: dict) -> dict:
    """Megatron tensors of layer ``i`` (symbol ``kind``) for the rank coordinates ``rank``
    (``tp, tp_rank, ep, ep_rank, etp, etp_rank``); names relative to ``decoder.layers.i.``."""
    p = f"model.layers.{i}."
    tp, r = rank["tp"], rank["tp_rank"]
    norm = hf_sd[p + "norm.weight"].clone()
    if kind == "M":
        mixer = {k[len(p + "mixer."):]: v for k, v in hf_sd.items() if k.startswith(p + "mixer.")}
        return {"norm.weight": norm, **{f"mixer.{k}": v for k, v in mamba_mixer_shard(mixer, tp, r, cfg).items()}}
    if kind == "*":
        q, k, v = (hf_sd[f"{p}mixer.{c}_proj.weight"] for c in "qkv")
        return {"input_layernorm.weight": norm,
                "self_attention.linear_qkv.weight": qkv_shard(q, k, v, cfg["num_key_value_heads"], tp, r),
                "self_attention.linear_proj.weight": _part(hf_sd[p + "mixer.o_proj.weight"], tp, r, 1)}
    if kind == "-":
        return {"pre_mlp_layernorm.weight": norm,
                "mlp.linear_fc1.weight": _part(hf_sd[p + "mixer.up_proj.weight"], tp, r),
                "mlp.linear_fc2.weight": _part(hf_sd[p + "mixer.down_proj.weight"], tp, r, 1)}
    shared = p + "mixer.shared_experts."
    return {"pre_mlp_layernorm.weight": norm, "mlp.router.weight": hf_sd[p + "mixer.gate.weight"].clone(),
            **expert_shards(hf_sd, p + "mixer.", rank["ep"], rank["ep_rank"], rank["etp"], rank["etp_rank"]),
            "mlp.shared_experts.linear_fc1.weight": _part(hf_sd[shared + "up_proj.weight"], tp, r),
            "mlp.shared_experts.linear_fc2.weight": _part(hf_sd[shared + "down_proj.weight"], tp, r, 1)}


def hf_to_megatron_rank(hf_sd: dict, cfg: dict, pattern: str, padded_vocab: int, rank: dict) -> tuple[dict, dict]:
    """(parameters, buffers) of one Megatron rank (pp=1) from an HF NemotronH state dict."""
    tp, r = rank["tp"], rank["tp_rank"]

    def vocab(t: torch.Tensor) -> torch.Tensor:  # pad rows to the padded vocab, then TP-chunk
        return _part(torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], t.shape[1])]), tp, r)

    params = {"embedding.word_embeddings.weight": vocab(hf_sd["model.embeddings.weight"])}
    buffers = {}
    for i, kind in enumerate(pattern):
        params.update({f"decoder.layers.{i}.{k}": v for k, v in layer_shard(hf_sd, i, kind, cfg, rank).items()})
        if kind == "E":
            buffers[f"decoder.layers.{i}.mlp.router.expert_bias"] = \
                hf_sd[f"model.layers.{i}.mixer.gate.e_score_correction_bias"].clone()
    params["decoder.final_norm.weight"] = hf_sd["model.norm_f.weight"].clone()
    params["output_layer.weight"] = vocab(hf_sd["lm_head.weight"])
    return params, buffers


# --------------------------------------------------------------------------- worker
def layouts_job(rank: int, world_size: int, port: int, hf_sd: dict, cfg: dict, layouts: list,
                tokens: torch.Tensor) -> dict:
    """Build, load and run the Megatron model at each (tp, ep, etp); per layout: this rank's
    parameter and buffer shapes, the shapes the conversion produced, and rank 0's logits."""
    from megatron.core import parallel_state as ps

    from megarefit.demo.megatron_cpu import init_parallel
    from megarefit.demo.megatron_mamba import build_mamba_model, mamba_forward_logits

    out = {}
    for tp, ep, etp in layouts:
        init_parallel(rank=rank, world_size=world_size, master_port=port, tp=tp, pp=1, ep=ep, etp=etp)
        arch = mamba_arch_from_hf(cfg, tp=tp)
        model = build_mamba_model(arch, seed=3)
        coords = {"tp": tp, "tp_rank": ps.get_tensor_model_parallel_rank(), "ep": ep,
                  "ep_rank": ps.get_expert_model_parallel_rank(), "etp": etp,
                  "etp_rank": ps.get_expert_tensor_parallel_rank()}
        params, buffers = hf_to_megatron_rank(hf_sd, cfg, arch.pattern, arch.padded_vocab_size, coords)
        own_params = dict(model.named_parameters())
        own_buffers = {k: v for k, v in model.named_buffers() if k.endswith("expert_bias")}
        with torch.no_grad():
            for own, new in ((own_params, params), (own_buffers, buffers)):
                for name in own.keys() & new.keys():
                    own[name].copy_(new[name])
        logits = mamba_forward_logits(model, tokens)
        out[(tp, ep, etp)] = {
            "model": {n: tuple(t.shape) for n, t in {**own_params, **own_buffers}.items()},
            "converted": {n: tuple(t.shape) for n, t in {**params, **buffers}.items()},
            "logits": logits if rank == 0 else None,
        }
    return out


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def runs(hf_model):
    return run_workers(layouts_job, world_size=2, args=(hf_model.state_dict(), HF_CONFIG, LAYOUTS, TOKENS),
                       timeout=600)


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    with torch.no_grad():
        return hf_model(TOKENS).logits.float()


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-ep{e}-etp{x}" for t, e, x in LAYOUTS])
def test_megatron_logits_equal_hf(runs, hf_logits, layout):
    got = runs[0][layout]["logits"][..., : HF_CONFIG["vocab_size"]]
    diff = (got - hf_logits).abs().max().item()
    print(f"{layout}: max |megatron - hf| = {diff:.3g} (scale {hf_logits.abs().max().item():.3g})")
    assert got.shape == hf_logits.shape
    assert diff < 1e-4
    assert hf_logits.abs().max().item() > 1.0  # a real signal


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-ep{e}-etp{x}" for t, e, x in LAYOUTS])
def test_parameter_names_and_shapes_equal_conversion(runs, layout):
    for rank in runs:
        got, want = rank[layout]["model"], rank[layout]["converted"]
        assert sorted(got.keys() - want.keys()) == [] and sorted(want.keys() - got.keys()) == []
        assert got == want


LAYER_NAMES = {  # parameters of one layer of each kind in the local spec (+ the router's expert_bias buffer)
    "M": ["mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj.weight", "mixer.conv1d.weight",
          "mixer.conv1d.bias", "mixer.norm.weight", "mixer.out_proj.weight", "norm.weight"],
    "*": ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"],
    "E": ["pre_mlp_layernorm.weight", "mlp.router.weight",
          *(f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(2) for i in (1, 2)),
          "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
          "mlp.router.expert_bias"],
    "-": ["pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"],
}


def test_layer_parameter_names(runs):
    """Names (in Megatron's registration order) and tp=2 / ep=2 shapes of each layer kind."""
    model = runs[1][(2, 2, 1)]["model"]  # rank 1: tp rank 1, ep rank 1 (global experts 2, 3)
    for i, kind in enumerate("M*E-"):
        prefix = f"decoder.layers.{i}."
        assert [n[len(prefix):] for n in model if n.startswith(prefix)] == LAYER_NAMES[kind]
    assert model["decoder.layers.0.mixer.in_proj.weight"] == (148, 64)  # (2*128 + 2*16 + 8) / 2
    assert model["decoder.layers.0.mixer.conv1d.weight"] == (80, 1, 4)  # (128 + 2*16) / 2
    assert model["decoder.layers.0.mixer.out_proj.weight"] == (64, 64)
    assert model["decoder.layers.1.self_attention.linear_qkv.weight"] == (64, 64)  # one query group
    assert model["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"] == (48, 64)  # etp 1
    assert model["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (40, 64)


def test_torch_scan_matches_hf_chunked_scan():
    """The recurrence equals transformers' chunked torch SSD (other chunk size, initial state)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hfm

    g = torch.Generator().manual_seed(1)
    b, l, h, p, grp, n = 2, 11, 4, 3, 2, 5
    x, dt = torch.randn(b, l, h, p, generator=g), torch.randn(b, l, h, generator=g)
    B, C = torch.randn(b, l, grp, n, generator=g), torch.randn(b, l, grp, n, generator=g)
    A, D, dt_bias = -torch.rand(h, generator=g) * 3, torch.randn(h, generator=g), torch.randn(h, generator=g)
    s0 = torch.randn(b, h, p, n, generator=g)
    kw = {"D": D, "dt_bias": dt_bias, "initial_states": s0, "dt_softplus": True, "return_final_states": True}
    y, s = torch_mamba_chunk_scan(x, dt, A, B, C, 4, **kw)
    y_ref, s_ref = hfm.mamba2_chunk_scan(x, dt, A, B, C, 4, **kw)
    assert (y - y_ref).abs().max().item() < 1e-4 and (s - s_ref).abs().max().item() < 1e-4


def test_arch_from_hf():
    arch = mamba_arch_from_hf(HF_CONFIG, tp=2)
    assert (arch.pattern, arch.padded_vocab_size, arch.shared_expert_ffn, arch.router_topk_scaling_factor) == \
        ("M*E-", 256, 80, 2.5)
    legacy = {k: v for k, v in HF_CONFIG.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M*E-"}
    assert mamba_arch_from_hf(legacy, tp=2) == arch


@pytest.mark.parametrize("change, words", [
    ({"layer_norm_epsilon": 1e-6}, "eps"), ({"norm_topk_prob": False}, "renormalises"),
    ({"n_groups": 1}, "tp=2"), ({"use_bias": True}, "bias"), ({"mlp_hidden_act": "silu"}, "relu2"),
    ({"n_shared_experts": 2}, "n_shared_experts"), ({"moe_latent_size": 32}, "latent"),
    ({"layers_block_type": ["linear_attention", "indexed_attention"]}, "indexed_attention"),
])
def test_arch_from_hf_refuses(change, words):
    with pytest.raises(MegarefitError, match=words):
        mamba_arch_from_hf(HF_CONFIG | change, tp=2)
