"""Run by tests/test_bridge_lora.py inside the Megatron-Bridge environment (Bridge 0.6.2 on megatron-core
0.19.2): a real Megatron-Core GPT (Qwen3-style, local layer spec, fp32, CPU, two gloo processes) wrapped
by Bridge's ``LoRA`` and ``CanonicalLoRA`` (r = 8, alpha = 12, every dense linear), adapters filled
with noise (Bridge initializes B to zero), at tp = 2 and tp = 1 (dp = 2 there: both processes run it,
rank 0 reports). Per case:

* the Megatron LoRA model's forward logits;
* megarefit's :class:`~megarefit.online.trainer.lora_merge.MergedLoRA` served copies of every rank,
  translated to HF by ``megatron_to_hf``, and HF transformers' logits on them;
* Bridge's ``export_hf_weights(..., merge_adapter_weights=True)`` (rank 0);
* Bridge's ``export_adapter_weights`` turned into PEFT's on-disk state by Bridge's own
  ``convert_adapter_weights_to_peft_state`` (what ``save_hf_adapter`` writes), against
  ``lora_to_peft`` of the raw adapter shards;
* megarefit's classifier on the wrapped model (every module class and ``partition_dim`` against
  the adapter rows);
* the adapter-only refit: the layout, rank and ``alpha`` / ``dim`` ``LoraPublisher.from_megatron`` reads
  from the model, and ``plan_lora_to_peft`` of them run over the adapter shards, against Bridge's PEFT
  state.

Bridge's ``peft.utils.HAVE_TE`` is set to False before the wrappers are applied: without
Transformer Engine, ``megatron.core.extensions.transformer_engine`` still defines the TE class names
(as placeholders that are not types), Bridge's ``safe_import_from`` reports them importable, and
``get_adapter_attributes_from_linear`` then calls ``isinstance(m, <placeholder>)``: TypeError.

Usage: ``python bridge_lora.py WORKDIR``; prints one JSON line.
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

CFG = _config("Qwen3-0.6B")
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
RANK, ALPHA = 8, 12  # alpha / r = 1.5: not a power of two, so the order of the scaling shows in the bits
WRAPPERS = ("lora", "canonical_lora")


def _noise_adapters(model: torch.nn.Module, tp_rank: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".adapter." in name:
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{tp_rank}".encode()))
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _case(wrapper: str, tp: int, work: str) -> dict:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.peft_bridge import convert_adapter_weights_to_peft_state
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state as ps

    from megarefit.demo.megatron_cpu import build_gpt_model, forward_logits, gpt_arch_from_hf, perturb_parameters_
    from megarefit.layout.classify import classify_model
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import megatron_core_of
    from megarefit.online.trainer.lora_merge import MergedLoRA

    model = build_gpt_model(gpt_arch_from_hf(CFG, tp=tp), seed=0)
    perturb_parameters_(model, seed=1)  # norms away from 1
    model = (LoRA if wrapper == "lora" else CanonicalLoRA)(dim=RANK, alpha=ALPHA)(model, training=False)
    t = ps.get_tensor_model_parallel_rank()
    _noise_adapters(model, t)
    res: dict = {"logits": forward_logits(model, TOKENS)}
    merged = MergedLoRA.from_megatron(model, CFG)
    res["served"] = {n: x.detach().clone() for n, x in merged.served.items()}
    res["adapters"] = {n: p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n}
    res["classified"] = [(c.name, c.module_class, c.role and c.role.value, c.problem)
                         for c in classify_model(model, ModelDims.from_hf_config(CFG)) if ".adapter." in c.name
                         or c.problem]
    res["gathered_bytes"] = merged.gathered_bytes
    res["lora_read"] = _lora_read(model)
    res["megatron"] = megatron_core_of(model)
    bridge = AutoBridge.from_hf_pretrained(str(Path(work) / "hf"), torch_dtype=torch.float32)
    res["bridge_merged"] = {k: v.detach().clone() for k, v in bridge.export_hf_weights(
        [model], cpu=True, show_progress=False, merge_adapter_weights=True)}
    exported = list(bridge.export_adapter_weights([model], cpu=True, show_progress=False))
    res["bridge_peft"] = convert_adapter_weights_to_peft_state(exported)[0]
    return res


def _lora_read(model: torch.nn.Module) -> dict:
    """What ``LoraPublisher.from_megatron`` serves of this rank (it reads the model as here; its NIXL
    agent is not built: the Bridge environment has no NIXL)."""
    import dataclasses

    from megarefit.layout.dims import ModelDims
    from megarefit.layout.megatron_model import read_chunks
    from megarefit.online.trainer.lora_merge import adapter_alpha_dim

    chunk, = read_chunks(model, ModelDims.from_hf_config(CFG))
    return {"rank": list(chunk.rank), "layout": dataclasses.replace(chunk.layout, dp=0).to_dict(),
            "replica": chunk.replica, "alpha_dim": list(adapter_alpha_dim(model)),
            "names": sorted(n for n in chunk.params if ".adapter." in n)}


def _planned_peft(cases: list[dict]) -> dict[str, torch.Tensor]:
    """The adapter-only refit's PEFT tensors: ``plan_lora_to_peft`` of the layout read from the model, run over
    every TP rank's adapter shards."""
    from megarefit.layout import RankCoord, SourceLayout
    from megarefit.layout.dims import ModelDims
    from megarefit.planner.lora_to_peft import adapter_rows, plan_lora_to_peft
    from megarefit.transport.execute import materialize
    from megarefit.transport.local import LocalTransport

    read = cases[0]["lora_read"]
    plan = plan_lora_to_peft(ModelDims.from_hf_config(CFG), SourceLayout.from_dict(read["layout"]), "float32",
                             read["alpha_dim"][1], adapter_rows(read["names"]))
    sources = {RankCoord(*c["lora_read"]["rank"]): c["adapters"] for c in cases}
    return {ref.name: t.clone() for ref, t in materialize(plan, LocalTransport(sources))}


def job(rank: int, world_size: int, master_port: int, work: str) -> dict:
    from megarefit.demo.megatron_cpu import apply_cpu_patches, init_parallel
    from megarefit.integrations.bridge import _import_bridge

    apply_cpu_patches()
    _import_bridge()
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False  # see the module docstring
    out = {}
    for tp in (2, 1):
        init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=tp, pp=1)
        for wrapper in WRAPPERS:
            out[f"{wrapper}-tp{tp}"] = _case(wrapper, tp, work)
    return out


def _compare(key: str, ranks: list[dict], hf_model_of) -> dict:
    from megarefit import megatron_to_hf
    from megarefit.translate_peft import lora_to_peft

    tp = 2 if key.endswith("tp2") else 1
    cases = [r[key] for r in ranks[:tp]]
    hf_state = megatron_to_hf({(t, 0, 0): c["served"] for t, c in enumerate(cases)}, CFG, tp=tp,
                              megatron=cases[0]["megatron"])
    bridge = cases[0]["bridge_merged"]
    hf_logits = hf_model_of(hf_state)(input_ids=TOKENS).logits.float()
    peft, peft_config = lora_to_peft({t: c["adapters"] for t, c in enumerate(cases)}, CFG, alpha=ALPHA)
    bridge_peft = cases[0]["bridge_peft"]
    planned = _planned_peft(cases)
    return {
        "planned_names_differ": sorted(set(planned) ^ set(bridge_peft)),
        "planned_bytes_differ": sorted(k for k in planned if k in bridge_peft and not torch.equal(planned[k],
                                                                                                bridge_peft[k])),
        "lora_read": [{k: c["lora_read"][k] for k in ("rank", "replica", "alpha_dim")} for c in cases],
        "merged_names_differ": sorted(set(hf_state) ^ set(bridge)),
        "merged_bytes_differ": sorted(k for k in hf_state if k in bridge and not torch.equal(hf_state[k], bridge[k])),
        "merged_max_abs_diff": max(float((hf_state[k] - bridge[k]).abs().max()) for k in hf_state if k in bridge),
        "logits_diff": float((cases[0]["logits"][..., :256] - hf_logits).abs().max()),
        "logits_max_abs": float(hf_logits.abs().max()),
        "peft_names_differ": sorted(set(peft) ^ set(bridge_peft)),
        "peft_bytes_differ": sorted(k for k in peft if k in bridge_peft and not torch.equal(peft[k], bridge_peft[k])),
        "peft_tensors": len(peft),
        "peft_config": peft_config,
        "classified": [c for case in cases for c in case["classified"]],
        "gathered_bytes": [c["gathered_bytes"] for c in cases],
        "adapter_shapes": {n: list(p.shape) for n, p in cases[0]["adapters"].items() if ".layers.0." in n},
    }


def main(work: Path) -> dict:
    import transformers

    from megarefit.demo import workers
    from megarefit.demo.workers import run_workers

    workers.PRELOAD = (*workers.PRELOAD, "bridge_preload")  # tests/bridge_preload.py: Bridge imported once

    config = transformers.AutoConfig.for_model(**CFG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "hf", safe_serialization=True)

    def hf_model_of(state: dict) -> torch.nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state), (missing, unexpected)
        return model

    ranks = run_workers(job, world_size=2, args=(str(work),), timeout=600)
    with torch.no_grad():
        return {key: _compare(key, ranks, hf_model_of) for key in ranks[0]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
