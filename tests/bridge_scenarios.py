"""Run by tests/test_bridge.py inside the Megatron-Bridge environment (transformers<5, see
requirements/bridge.txt). Prints one JSON line: per case, megarefit's name map looked up
in Bridge's registry, and the disagreements :func:`megarefit.planner.namemap.compare` finds.

Cases are tiny configs built from the real ones in tests/data/configs. "model" cases
also build a real Megatron-Core model on CPU (one process, gloo) and resolve Bridge's
``AutoMapping`` against each parameter's owning module, as Bridge's export would.
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

# name -> (config, extra, layouts as (tp, pp, ep, layer_spec, expert_layout), build a real model?)
CASES = {
    "llama": ("Llama-3.1-8B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen2": ("Qwen2.5-0.5B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen3": ("Qwen3-0.6B", DENSE, [(2, 2, 1, "te", "sequential"), (1, 1, 1, "local", "sequential")], True),
    "qwen3_moe": ("Qwen3-30B-A3B", MOE, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential"),
                                         (2, 1, 2, "local", "sequential"), (1, 1, 2, "local", "legacy_grouped")],
                  True),
    "deepseek_v3": ("DeepSeek-V3", MOE | MLA, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")],
                    True),
    "glm4_moe": ("GLM-4.5-Air", MOE, [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")], True),
    # with one multi-token-prediction layer (Bridge adds GLM's MTP mappings when the config has them)
    "deepseek_v3_mtp": ("DeepSeek-V3", MOE | MLA | MTP, [(2, 2, 2, "te", "te_grouped")], False),
    "glm4_moe_mtp": ("GLM-4.5-Air", MOE | MTP, [(2, 2, 2, "te", "te_grouped")], False),
    "mixtral": ("Mixtral-8x7B-v0.1", MOE, [(1, 1, 2, "te", "te_grouped")], False),
    # fused experts with biases (etp 1, Megatron-Core's rule), attention sinks, router bias
    # hybrid Mamba2 (Megatron-Core MambaModel names); no CPU model: Mamba needs mamba-ssm to build
    "nemotron_h": ("NVIDIA-Nemotron-3-Nano-30B-A3B", {"num_hidden_layers": 4, "hybrid_override_pattern": "ME*-",
                                                      "n_routed_experts": 4, "mamba_num_heads": 8,
                                                      "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
                                                      "moe_shared_expert_intermediate_size": 48},
                   [(2, 1, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")], False),
    "gpt_oss": ("gpt-oss-120b", MOE | {"intermediate_size": 32, "layer_types": ["full_attention"] * 4},
                [(2, 2, 2, "te", "te_grouped"), (1, 1, 1, "local", "sequential")], True),
}


def config(name: str, extra: dict) -> dict:
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / f"{name}.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update(SMALL)
    cfg.update({k: v for k, v in extra.items()})
    return cfg


def _model_modules(cfg: dict, entries: list) -> dict:
    """A real Megatron-Core model (tp = pp = ep = 1) and each parameter's owning module."""
    from megarefit.integrations.bridge import resolve_modules
    from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf, init_parallel
    from megarefit.demo.workers import free_port

    init_parallel(rank=0, world_size=1, master_port=free_port(), tp=1, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(cfg, tp=1), seed=0)
    return resolve_modules(model, entries)


def run() -> dict:
    from megarefit import ModelDims, SourceLayout
    from megarefit.errors import UnsupportedModelError
    from megarefit.integrations.bridge import bridge_name_map, bridge_patterns, bridge_version, rows_from_bridge
    from megarefit.planner.namemap import compare, name_map

    out: dict = {"bridge_version": bridge_version(), "cases": {}}
    for key, (name, extra, layouts, build) in CASES.items():
        cfg = config(name, extra)
        dims = ModelDims.from_hf_config(cfg)
        try:
            patterns = bridge_patterns(cfg)
        except UnsupportedModelError as exc:
            out["cases"][key] = {"unsupported": str(exc)}
            continue
        case: dict = {"patterns": len(patterns), "layouts": {}}
        for tp, pp, ep, spec, experts in layouts:
            layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=dims.default_etp(tp),
                                        padded_vocab_size=dims.padded_vocab_size(tp),
                                        num_layers=dims.num_layers, layer_spec=spec, expert_layout=experts,
                                        mtp_layers=dims.mtp_layers)
            entries = name_map(dims, layout)
            modules = _model_modules(cfg, entries) if build and (tp, pp, ep, spec) == (1, 1, 1, "local") else None
            mapped = bridge_name_map(entries, cfg, modules)
            result = case["layouts"][f"tp{tp}-pp{pp}-ep{ep}-{spec}-{experts}"] = {
                "entries": [e.to_dict() for e in mapped],
                "disagreements": [d.__dict__ for d in compare(mapped)],
                "resolved_kinds": sorted({e.other_kind for e in mapped if ":" in (e.other_kind or "")}),
            }
            if modules is not None:  # a spec table generated from Bridge vs megarefit's own rows
                conds = dims.conditions(layout.pp)
                ours = {(r.megatron, r.role.value, r.hf) for e in mapped if e.other_kind and not e.duplicate
                        for r in [dims.spec.match(e.local, conds, spec, expert_layout=experts).spec]}
                result["rows_ours"] = sorted(ours)
                result["rows_bridge"] = sorted((g.megatron, g.role, g.hf) for g in rows_from_bridge(mapped))
        out["cases"][key] = case
    return out


if __name__ == "__main__":
    print(json.dumps(run()))
