"""Run by tests/test_bridge_lora.py inside the Megatron-Bridge environment (Bridge 0.6.2 on megatron-core
0.19.2): Bridge's ``LoRA`` and ``CanonicalLoRA`` (r = 8, alpha = 12, the default ``target_modules``) on a
real Megatron-Core GLM-4.5-style MoE (local layer spec, SequentialMLP experts, fp32, CPU, two gloo
processes): a dense first layer, then a layer of 4 routed experts and a shared expert, every one of their
``linear_fc1`` / ``linear_fc2`` adapted. Adapters are filled with noise keyed by name, TP rank and EP rank
(Bridge initializes B to zero; the EP rank makes each global expert's adapter its own).

Layouts ``(tp, ep, etp)``: (2, 1, 1) splits the dense and shared-expert adapters over TP, (2, 2, 1) also
spreads the experts over two EP ranks, (1, 2, 1) is data-parallel for the dense layers. Per case, as
tests/bridge_lora.py: the Megatron LoRA model's forward logits; megarefit's ``MergedLoRA`` served copies
of every rank, translated to HF by ``megatron_to_hf``; Bridge's ``export_hf_weights(...,
merge_adapter_weights=True)``; the classifier on the wrapped model; the adapters' local shapes. One case
trains with Bridge's ``normalize_moe_lora`` (experts' rank ``dim // moe_router_topk``, their own scale).

At (2, 1, 2) (expert-TP 2) ``MergedLoRA`` refuses the routed experts' ``linear_fc2`` adapters. The case
records the refusal and what it rests on, measured on the real modules: the expert-TP sum (what the MoE
dispatcher computes) of expert 0's wrapped ``linear_fc2`` outputs against the sum of ``x_t (W_t + s B A_t)^T``
from the module's own factors.

Usage: ``python bridge_lora_moe.py WORKDIR``; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import warnings
import zlib
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))
from bridge_contents import _config

CFG = _config("GLM-4.5-Air", n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, num_experts_per_tok=2,
              first_k_dense_replace=1, n_group=1, topk_group=1, num_nextn_predict_layers=0, pad_token_id=0,
              bos_token_id=0, eos_token_id=1)
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
RANK, ALPHA = 8, 12
CASES = {"lora-tp2": ("lora", 2, 1, 1), "canonical_lora-tp2": ("canonical_lora", 2, 1, 1),
         "lora-tp2-ep2": ("lora", 2, 2, 1), "canonical_lora-tp1-ep2": ("canonical_lora", 1, 2, 1),
         "lora-tp1-ep2-normalized": ("lora", 1, 2, 1)}  # normalize_moe_lora: experts' dim = 8 // top-k 2 = 4
REFUSED = ("lora", 2, 1, 2)  # expert-TP 2: the experts' linear_fc2 adapters are refused (Bridge issue #5634)


def _noise_adapters(model: torch.nn.Module, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Noise keyed by name and the split's rank (expert-TP and EP rank for routed experts, TP rank otherwise), so
    data-parallel copies (expert-DP for experts) agree, as training keeps them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".adapter." in name:
                key = f"{name}:{etp_rank}:{ep_rank}" if ".local_experts." in name else f"{name}:{tp_rank}"
                p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))))


def _case(wrapper: str, tp: int, work: str, normalize: bool = False) -> dict:
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state as ps

    from megarefit.demo.megatron_cpu import build_gpt_model, forward_logits, gpt_arch_from_hf, perturb_parameters_
    from megarefit.layout.classify import classify_model
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import megatron_core_of, read_chunks
    from megarefit.online.trainer.lora_merge import MergedLoRA

    dims = ModelDims.from_hf_config(CFG)
    model = build_gpt_model(gpt_arch_from_hf(CFG, tp=tp), seed=0)
    perturb_parameters_(model, seed=1)
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] if wrapper == "lora" else [
        "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]
    model = (LoRA if wrapper == "lora" else CanonicalLoRA)(target_modules=targets, dim=RANK, alpha=ALPHA,
                                                           normalize_moe_lora=normalize)(model, training=False)
    _noise_adapters(model, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                    ps.get_expert_tensor_parallel_rank())
    res: dict = {"logits": forward_logits(model, TOKENS)}
    merged = MergedLoRA.from_megatron(model, CFG)
    res["served"] = {n: x.detach().clone() for n, x in merged.served.items()}
    res["rank"] = list(read_chunks(model, dims)[0].rank)
    res["classified"] = [(c.name, c.module_class, c.role and c.role.value, c.problem)
                         for c in classify_model(model, dims) if ".adapter." in c.name or c.problem]
    res["adapter_shapes"] = {n: list(p.shape) for n, p in model.named_parameters()
                             if ".adapter." in n and ".layers.1." in n and ".local_experts.1." not in n}
    res["gathered_bytes"] = merged.gathered_bytes
    res["megatron"] = megatron_core_of(model)
    bridge = AutoBridge.from_hf_pretrained(str(Path(work) / "hf"), torch_dtype=torch.float32)
    res["bridge_merged"] = {k: v.detach().clone() for k, v in bridge.export_hf_weights(
        [model], cpu=True, show_progress=False, merge_adapter_weights=True)}
    return res


def _sequential_glm45() -> None:
    """Bridge 0.6.2's GLM-4.5 registry maps only grouped experts (``mlp.experts.linear_fc1.weight*``); add the
    SequentialMLP names with the mapping classes Bridge's own Qwen3.5 registry uses for them
    (``_moe_routed_expert_mappings``): names only, the export's gathering and merging stay Bridge's."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    original = GLM45Bridge.mapping_registry
    hf, mg = "model.layers.*.mlp.experts.*.", "decoder.layers.*.mlp.experts.local_experts.*."

    def with_sequential(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*original(self).mappings, GatedMLPMapping(
            megatron_param=mg + "linear_fc1.weight", gate=hf + "gate_proj.weight", up=hf + "up_proj.weight"),
            AutoMapping(megatron_param=mg + "linear_fc2.weight", hf_param=hf + "down_proj.weight"))

    GLM45Bridge.mapping_registry = with_sequential


def _refused_case() -> dict:
    """The expert-TP 2 case: MergedLoRA's refusal, and the gap between what Bridge's wrapped expert ``linear_fc2``
    computes (summed over expert-TP, as the dispatcher sums it) and the merged weight's product."""
    import torch.distributed as dist
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state as ps

    from megarefit.demo.megatron_cpu import build_gpt_model, gpt_arch_from_hf
    from megarefit.errors import UnsupportedAdapterError
    from megarefit.online.trainer.lora_merge import MergedLoRA

    model = LoRA(dim=RANK, alpha=ALPHA)(build_gpt_model(gpt_arch_from_hf(CFG, tp=2), seed=0), training=False)
    t, group = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_group()
    _noise_adapters(model, t, 0, t)
    try:
        MergedLoRA.from_megatron(model, CFG)
        refusal = None
    except UnsupportedAdapterError as exc:
        refusal = str(exc)
    fc2 = model.decoder.layers[1].mlp.experts.local_experts[0].linear_fc2
    x = torch.randn(5, fc2.to_wrap.weight.shape[1], generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        got = fc2(x)[0]
        b = [torch.empty_like(fc2.adapter.linear_out.weight) for _ in range(2)]
        dist.all_gather(b, fc2.adapter.linear_out.weight.contiguous(), group=group)
        want = x @ fc2.to_wrap.weight.T + (ALPHA / RANK) * (x @ fc2.adapter.linear_in.weight.T) @ torch.cat(b).T
        for y in (got, want):
            dist.all_reduce(y, group=group)
    return {"refusal": refusal, "fc2_gap": float((got - want).abs().max()), "fc2_max_abs": float(want.abs().max())}


def job(rank: int, world_size: int, master_port: int, work: str) -> dict:
    from megarefit.demo.megatron_cpu import apply_cpu_patches, init_parallel
    from megarefit.integrations.bridge import _import_bridge

    apply_cpu_patches()
    _import_bridge()
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False  # see tests/bridge_lora.py
    _sequential_glm45()
    out = {}
    for key, (wrapper, tp, ep, etp) in CASES.items():
        init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=tp, pp=1, ep=ep, etp=etp)
        out[key] = _case(wrapper, tp, work, normalize=key.endswith("normalized"))
    _, tp, ep, etp = REFUSED
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=tp, pp=1, ep=ep, etp=etp)
    out["refused"] = _refused_case()
    return out


def _compare(key: str, ranks: list[dict], hf_model_of) -> dict:
    from megarefit import megatron_to_hf

    _, tp, ep, etp = CASES[key]
    cases = {tuple(r[key]["rank"]): r[key] for r in ranks}  # (tp, pp, ep): both ranks hold distinct pairs here
    first = ranks[0][key]
    hf_state = megatron_to_hf({k: c["served"] for k, c in cases.items()}, CFG, tp=tp, ep=ep, etp=etp,
                              megatron=first["megatron"])
    bridge = first["bridge_merged"]
    hf_logits = hf_model_of(hf_state)(input_ids=TOKENS).logits.float()
    return {
        "ranks": sorted(cases),
        "merged_names_differ": sorted(set(hf_state) ^ set(bridge)),
        "merged_bytes_differ": sorted(k for k in hf_state if k in bridge and not torch.equal(hf_state[k], bridge[k])),
        "merged_max_abs_diff": max(float((hf_state[k] - bridge[k]).abs().max()) for k in hf_state if k in bridge),
        "logits_diff": float((first["logits"][..., :256] - hf_logits).abs().max()),
        "logits_max_abs": float(hf_logits.abs().max()),
        "classified": [c for r in ranks for c in r[key]["classified"]],
        "gathered_bytes": [r[key]["gathered_bytes"] for r in ranks],
        "adapter_shapes": first["adapter_shapes"],
    }


def main(work: Path) -> dict:
    import transformers

    from megarefit.demo import workers
    from megarefit.demo.workers import run_workers
    from megarefit.integrations.hf import save_checkpoint

    workers.PRELOAD = (*workers.PRELOAD, "bridge_preload")  # tests/bridge_preload.py: Bridge imported once

    config = transformers.AutoConfig.for_model(**CFG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "hf", safe_serialization=True)

    def hf_model_of(state: dict) -> torch.nn.Module:
        """transformers' model from ``state`` saved as an HF checkpoint (from_pretrained fuses the per-expert
        tensors as transformers 5 holds them); no key missing, unexpected or mismatched."""
        save_checkpoint(work / "merged", CFG, state)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(work / "merged", output_loading_info=True,
                                                                        dtype=torch.float32)
        assert not any(info.values()), info
        return model.eval()

    ranks = run_workers(job, world_size=2, args=(str(work),), timeout=600)
    with torch.no_grad():
        return {**{key: _compare(key, ranks, hf_model_of) for key in CASES}, "refused": [r["refused"] for r in ranks]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
