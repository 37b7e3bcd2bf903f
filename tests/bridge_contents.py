"""Run by tests/test_bridge.py inside the Megatron-Bridge environment: the same HF checkpoint
loaded into the same real Megatron-Core model (megatron-core 0.19.2, TP=2, two gloo processes on
CPU) by Bridge 0.6.2 (``AutoBridge.load_hf_weights``) and by megarefit (``hf_to_megatron``, planned
for the model's own Megatron-Core record); the two loads compared tensor by tensor, and Bridge's own
export (``export_hf_weights``) after each load. Two models:

* ``qwen3`` (Qwen3-style, dense): also Megatron's forward logits of each load vs HF transformers'
  logits of the checkpoint;
* ``minimax`` (MiniMax-M2: q / k norms over all heads, the model built with Bridge's own
  ``FullDimQNorm`` / ``FullDimKNorm``; sigmoid routing with a score-correction bias; RoPE on half of
  each head): megarefit's load, Megatron's logits vs HF's. Bridge's own load fails on CPU at TP=2
  (its ``_FullDimQKNormMapping`` puts the weight on ``torch.device("cuda", ...)``) and its export
  fails on SequentialMLP experts, which it maps only in the TE-grouped form: both recorded, asserted
  as they are. The config carries ``partial_rotary_factor`` beside ``rotary_dim``: transformers 5.12.1
  ignores ``rotary_dim`` (full RoPE), 5.19 reads it;
* ``glm5`` (GLM-5-style: MLA, MoE with a dense first layer and a shared expert, the DSA indexer,
  whose heads megatron-core 0.19 lays out as HF does): loads and exports only. Its logits are not
  compared: transformers 5.12.1 (the newest Bridge 0.6.2 allows) ropes the GLM-5 indexer's
  half-split pairs, where GLM-5, transformers 5.19 (the main environment) and Megatron with
  ``dsa_indexer_rope_interleaved=True`` rope interleaved pairs (measured: both loads' logits
  1.4 off transformers 5.12.1's, the size the docs give for the wrong indexer RoPE).

Without Transformer Engine, MLA's down-projections are Megatron-Core's local ``Linear`` and the
harness's DSA indexer linears ``DuplicatedLinear``, both whole on every rank as TE's ``TELinear``
(``parallel_mode="duplicated"``) is; Bridge's ``AutoMapping`` does not know these classes, so
they are registered as replicated (``AutoMapping.register_module_type``, Bridge's own extension
point) before Bridge loads GLM-5.

Usage: ``python bridge_contents.py WORKDIR``; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def _config(name: str, **extra) -> dict:
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / f"{name}.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 256, "intermediate_size": 96, "num_hidden_layers": 2, "rope_scaling": None,
                "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32"} | extra)
    return cfg


CASES = {
    "qwen3": _config("Qwen3-0.6B"),
    "glm5": _config("GLM-5", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, qk_head_dim=24, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                    num_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
                    index_n_heads=4, index_head_dim=16, index_topk=4),
    "minimax": _config("MiniMax-M2.5", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                       rotary_dim=8, partial_rotary_factor=0.5, use_mtp=False, num_mtp_modules=0),
}
BRIDGE_NORMS: dict = {}  # case -> Bridge's (q_layernorm, k_layernorm) classes, filled in the workers
LOGITS = ("qwen3", "minimax")  # cases whose Megatron logits are compared with HF's (see the module docstring)


def _export(bridge, model) -> dict | str:
    try:
        return {k: v.detach().clone() for k, v in bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return f"{type(exc).__name__}: {exc}"


def _load(bridge, model) -> str:
    try:
        bridge.load_hf_weights([model])
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def job(rank: int, world_size: int, master_port: int, work: str) -> dict:
    import safetensors.torch

    from megarefit import hf_to_megatron
    from megarefit.demo.megatron_cpu import (
        HARNESS_MODULE_MODES,
        apply_cpu_patches,
        build_gpt_model,
        forward_logits,
        gpt_arch_from_hf,
        init_parallel,
    )
    from megarefit.integrations.bridge import _import_bridge
    from megarefit.integrations.megatron import megatron_core_of, refit_tensors

    apply_cpu_patches()
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=2, pp=1)
    _import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    for cls, mode in {"Linear": "replicated", **HARNESS_MODULE_MODES}.items():  # TELinear "duplicated" stand-ins
        AutoMapping.register_module_type(cls, mode)
    from megatron.bridge.models.minimax_m2.minimax_m2_provider import FullDimKNorm, FullDimQNorm

    BRIDGE_NORMS["minimax"] = (FullDimQNorm, FullDimKNorm)  # the model's q / k norms: Bridge's own
    out = {}
    for key, cfg in CASES.items():
        ckpt = Path(work) / key
        model = build_gpt_model(gpt_arch_from_hf(cfg, tp=2), seed=0, qk_norms=BRIDGE_NORMS.get(key))
        bridge = AutoBridge.from_hf_pretrained(str(ckpt), torch_dtype=torch.float32)
        params = refit_tensors(model)
        res: dict = {"bridge_load": _load(bridge, model)}
        bridge_load = {name: t.detach().clone() for name, t in params.items()}
        if res["bridge_load"] == "ok":
            res["bridge_export"] = _export(bridge, model)
            if key in LOGITS:
                res["bridge_logits"] = forward_logits(model, TOKENS)
        hf_state = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
        with torch.no_grad():
            for name, t in hf_to_megatron(hf_state, cfg, tp=2, megatron=megatron_core_of(model))[(rank, 0, 0)].items():
                params[name].copy_(t)
        res["loads_differ"] = sorted(n for n, t in params.items() if not torch.equal(t, bridge_load[n])) \
            if res["bridge_load"] == "ok" else None
        res["params"] = len(params)
        if key in LOGITS:
            res["megarefit_logits"] = forward_logits(model, TOKENS)
        res["bridge_export_of_megarefit_load"] = _export(bridge, model)  # Bridge's export on its own
        out[key] = res
    return out


def main(work: Path) -> dict:
    import safetensors.torch
    import transformers

    from megarefit.demo.workers import run_workers

    hf_states, want = {}, {}
    for key, cfg in CASES.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).float().eval()
        with torch.no_grad():
            for p in hf.parameters():  # norms away from 1 so a swapped or skipped tensor shows
                p.add_(0.05 * torch.randn_like(p))
            for name, b in hf.named_buffers():  # MiniMax-M2's router bias (zeros as built)
                if name.endswith("e_score_correction_bias"):
                    b.add_(0.1 * torch.randn_like(b))
        hf.save_pretrained(work / key, safe_serialization=True)
        hf_states[key] = safetensors.torch.load_file(str(work / key / "model.safetensors"))
        if key in LOGITS:
            with torch.no_grad():
                want[key] = hf(input_ids=TOKENS).logits.float()
    ranks = run_workers(job, world_size=2, args=(str(work),), timeout=600)

    def mismatched(export: dict | str, hf_state: dict) -> list[str] | str:
        if isinstance(export, str):
            return export
        return sorted(k for k in hf_state if k not in export or not torch.equal(export[k].float(), hf_state[k]))

    out = {}
    for key in CASES:
        rank0 = ranks[0][key]
        res = {"params": [r[key]["params"] for r in ranks], "bridge_load": rank0["bridge_load"],
               "loads_differ": sorted({f"rank{i}:{n}" for i, r in enumerate(ranks) for n in r[key]["loads_differ"] or ()}),
               "bridge_export_mismatched": mismatched(rank0.get("bridge_export", "no Bridge load"), hf_states[key]),
               "bridge_export_of_megarefit_load_mismatched": mismatched(rank0["bridge_export_of_megarefit_load"],
                                                                        hf_states[key])}
        if key in LOGITS:
            res["hf_max_abs"] = float(want[key].abs().max())
            for who in ("bridge", "megarefit"):
                if f"{who}_logits" in rank0:
                    res[f"{who}_logits_diff"] = float((rank0[f"{who}_logits"][..., :256].float() - want[key]).abs().max())
        out[key] = res
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
