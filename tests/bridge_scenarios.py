"""Run by tests/test_bridge.py inside the Megatron-Bridge environment (Bridge 0.6.2 on megatron-core
0.19.2, see requirements/bridge.txt). Prints one JSON line: per case, megarefit's name map looked up
in Bridge's registry, and the disagreements :func:`megarefit.planner.namemap.compare` finds.

Cases are tiny configs built from the real ones in tests/data/configs. Name maps are planned for the
megatron-core installed here (the release Bridge runs on), unless a layout names another verified
release: the 0.16 names (MTP ``transformer_layer``, Mamba ``conv1d.weight``, legacy ``GroupedMLP``)
are looked up too, by name only. "model" cases also build a real Megatron-Core model on CPU (one
process, gloo) and resolve Bridge's ``AutoMapping`` against each parameter's owning module, as
Bridge's export would.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

MOE = {"num_hidden_layers": 4, "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}
DENSE = {"num_hidden_layers": 4}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
         "intermediate_size": 96, "moe_intermediate_size": 32, "rope_scaling": None, "max_position_embeddings": 256,
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1}
MTP = {"num_nextn_predict_layers": 1}
MLA = {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "scoring_func": "sigmoid"}
DSA = {"qk_head_dim": 24, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4}  # GLM-5's indexer
NEMOTRON_H = {"num_hidden_layers": 4, "hybrid_override_pattern": "ME*-", "n_routed_experts": 4, "mamba_num_heads": 8,
              "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "moe_shared_expert_intermediate_size": 48}
OLD = "0.16.1"  # megarefit's reference release: the names megatron-core used before 0.17 / 0.19

QWEN35 = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
          "layer_types": ["linear_attention", "full_attention"] * 2, "num_experts": 4, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 16}
MINIMAX = {"num_hidden_layers": 4, "num_local_experts": 4, "intermediate_size": 32, "rotary_dim": 8, "use_mtp": False,
           "num_mtp_modules": 0}
DSV4 = {"num_hidden_layers": 4, "num_key_value_heads": 1, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "hc_mult": 4,
        "num_experts_per_tok": 2, "n_routed_experts": 4, "num_nextn_predict_layers": 0}
QWEN3_NEXT = QWEN35 | {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
# name -> (config, extra, layouts as (tp, pp, ep, layer_spec, expert_layout[, megatron-core version]),
#          build a real model?); without a version a layout is planned for the installed megatron-core
CASES = {
    "llama": ("Llama-3.1-8B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "mistral": ("Mistral-7B-v0.3", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen2": ("Qwen2.5-0.5B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen3": ("Qwen3-0.6B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen3_moe": ("Qwen3-30B-A3B", MOE, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential"),
                                         (2, 1, 2, "local", "sequential"), (1, 1, 2, "local", "legacy_grouped", OLD)],
                  True),
    "deepseek_v3": ("DeepSeek-V3", MOE | MLA, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")],
                    True),
    "kimi_k2": ("Kimi-K2-Instruct", MOE | MLA, [(2, 2, 2, "te", "te_grouped")], False),  # DeepseekV3ForCausalLM
    "glm4_moe": ("GLM-4.5-Air", MOE, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")], True),
    # GLM-5: MLA + MoE + the DSA lightning indexer (0.19 lays its heads out as HF: no row rotation)
    "glm_moe_dsa": ("GLM-5", MOE | MLA | DSA, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")],
                    True),
    # with one multi-token-prediction layer, under the installed release's name (0.17+: mtp_model_layer)
    # and the 0.16 one (transformer_layer)
    "deepseek_v3_mtp": ("DeepSeek-V3", MOE | MLA | MTP, [(2, 2, 2, "te", "te_grouped"),
                                                         (2, 2, 2, "te", "te_grouped", OLD)], False),
    "glm4_moe_mtp": ("GLM-4.5-Air", MOE | MTP, [(2, 2, 2, "te", "te_grouped"), (2, 2, 2, "te", "te_grouped", OLD)],
                     False),
    "glm_moe_dsa_mtp": ("GLM-5", MOE | MLA | DSA | MTP, [(2, 2, 2, "te", "te_grouped"),
                                                         (2, 2, 2, "te", "te_grouped", OLD)], False),
    "mixtral": ("Mixtral-8x7B-v0.1", MOE, [(1, 1, 2, "te", "te_grouped")], False),
    # hybrid Mamba2 (Megatron-Core MambaModel / HybridModel names): mixer.conv1d_weight from 0.19,
    # mixer.conv1d.weight before (Bridge maps the Mamba mixer with explicit classes)
    "nemotron_h": ("NVIDIA-Nemotron-3-Nano-30B-A3B", NEMOTRON_H,
                   [(2, 1, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential"),
                    (1, 1, 1, "local", "sequential", OLD)], True),
    # Qwen3.5-MoE's language model (the text architecture Bridge registers): gated DeltaNet and gated attention
    "qwen3_5_moe": ("Qwen3.5-397B-A17B", QWEN35, [(2, 2, 2, "te", "te_grouped"), (1, 1, 2, "local", "sequential")],
                    False),
    # Qwen3-Next: in_proj_qkvz / in_proj_ba packed per key head (Bridge's GDNLinearMapping)
    "qwen3_next": ("Qwen3-Next-80B-A3B-Thinking", QWEN3_NEXT, [(2, 2, 2, "te", "te_grouped"),
                                                               (1, 1, 2, "local", "sequential")], False),
    # MiniMax-M2: q / k norms over all heads, split over TP by heads (Bridge's _FullDimQKNormMapping)
    "minimax_m2": ("MiniMax-M2.5", MINIMAX, [(2, 2, 2, "te", "te_grouped"), (2, 1, 2, "local", "sequential")],
                   False),
    # DeepSeek-V4 (Megatron-LM's dev branch names, tp 1): compressors / indexers by compress_ratios, hash routing,
    # hyper-connection alphas packed into hc_*_scale (Bridge's _HCAlphaMapping)
    "deepseek_v4": ("DeepSeek-V4-Flash", DSV4, [(1, 2, 2, "te", "te_grouped"), (1, 1, 2, "local", "sequential")],
                    False),
    # fused experts with biases (etp 1, Megatron-Core's rule), attention sinks, router bias
    "gpt_oss": ("gpt-oss-120b", MOE | {"intermediate_size": 32, "layer_types": ["full_attention"] * 4},
                [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")], True),
}


def config(name: str, extra: dict) -> dict:
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / f"{name}.json").read_text())
    cfg = cfg.get("text_config", cfg)  # a vision-language checkpoint: its language model
    cfg.pop("quantization_config", None)
    cfg.update(SMALL)
    cfg.update({k: v for k, v in extra.items()})
    return cfg


def _model(cfg: dict):
    """A real Megatron-Core model (tp = pp = ep = 1) on the installed release: a ``GPTModel``, or for
    Nemotron-H a hybrid ``MambaModel`` (torch Mamba kernels, no mamba-ssm)."""
    from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf, init_parallel
    from megarefit.demo.workers import free_port

    init_parallel(rank=0, world_size=1, master_port=free_port(), tp=1, pp=1)
    if "hybrid_override_pattern" in cfg:
        from megarefit.demo.megatron_mamba import build_mamba_model, mamba_arch_from_hf

        return build_mamba_model(mamba_arch_from_hf(cfg, tp=1), seed=0)
    return build_gpt_model(gpt_arch_from_hf(cfg, tp=1), seed=0)


def run() -> dict:
    import megatron.core

    from megarefit import ModelDims, SourceLayout
    from megarefit.demo.megatron_cpu import HARNESS_MODULE_MODES
    from megarefit.errors import UnsupportedModelError
    from megarefit.integrations.bridge import (
        bridge_name_map,
        bridge_patterns,
        bridge_unknown_modules,
        bridge_version,
        resolve_modules,
        rows_from_bridge,
    )
    from megarefit.integrations.megatron import megatron_core_of
    from megarefit.planner.namemap import compare, name_map
    from megarefit.specs.megatron_core import MegatronCore

    # module classes Bridge's AutoMapping cannot resolve, each standing in for TE's TELinear with
    # parallel_mode="duplicated" (whole on every rank), which Bridge resolves to replicated:
    # Megatron-Core's local Linear (MLA down-projections without TE) and the harness's DSA indexer linears
    TE_STAND_INS = {"Linear": "replicated", **HARNESS_MODULE_MODES}
    installed = megatron.core.__version__
    out: dict = {"bridge_version": bridge_version(), "megatron_core": installed, "cases": {}}
    for key, (name, extra, layouts, build) in CASES.items():
        cfg = config(name, extra)
        dims = ModelDims.from_hf_config(cfg)
        try:
            patterns = bridge_patterns(cfg)
        except UnsupportedModelError as exc:
            out["cases"][key] = {"unsupported": str(exc)}
            continue
        case: dict = {"patterns": len(patterns), "layouts": {}}
        for tp, pp, ep, spec, experts, *version in layouts:
            real = build and (tp, pp, ep, spec) == (1, 1, 1, "local") and not version
            model = _model(cfg) if real else None
            # a real model's own record (version + config flags); else the release's verified flags
            record = megatron_core_of(model) if real else MegatronCore.verified(version[0] if version else installed)
            layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=dims.default_etp(tp),
                                        padded_vocab_size=dims.padded_vocab_size(tp),
                                        num_layers=dims.num_layers, layer_spec=spec, expert_layout=experts,
                                        mtp_layers=dims.mtp_layers, megatron=record)
            entries = name_map(dims, layout)
            modules = resolve_modules(model, entries) if real else None
            unknown = bridge_unknown_modules(entries, cfg, modules) if real else {}
            mapped = bridge_name_map(entries, cfg, modules, module_modes=TE_STAND_INS)
            name = f"tp{tp}-pp{pp}-ep{ep}-{spec}-{experts}" + (f"-mcore{version[0]}" if version else "")
            result = case["layouts"][name] = {
                "megatron_core": record.version,
                "entries": [e.to_dict() for e in mapped],
                "disagreements": [d.__dict__ for d in compare(mapped)],
                "resolved_kinds": sorted({e.other_kind for e in mapped if ":" in (e.other_kind or "")}),
                "bridge_unknown_modules": unknown,
            }
            if modules is not None:  # a spec table generated from Bridge vs megarefit's own rows
                conds = dims.conditions(layout.pp, layout.megatron)
                ours = {(r.megatron, r.role.value, r.hf) for e in mapped if e.other_kind and not e.duplicate
                        for r in [dims.spec.match(e.local, conds, spec, expert_layout=experts).spec]}
                result["rows_ours"] = sorted(ours)
                result["rows_bridge"] = sorted((g.megatron, g.role, g.hf) for g in rows_from_bridge(mapped))
        out["cases"][key] = case
    return out


if __name__ == "__main__":
    print(json.dumps(run()))
