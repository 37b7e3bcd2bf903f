"""By hand, on a GPU with Transformer Engine (the device tool's H200; not in CI, which has neither): the
same cases as tests/bridge_lora.py, on Megatron-Core's Transformer Engine layer spec instead of the local
one. Real TE modules (``TELayerNormColumnParallelLinear`` with the input norm fused into ``linear_qkv`` /
``linear_fc1``, ``TERowParallelLinear``, TE's ``RMSNorm`` as q / k norms) wrapped by Bridge 0.6.2's
``LoRA`` and ``CanonicalLoRA`` with real TE present (Bridge's ``HAVE_TE`` true), one process, tp 1, fp32:

* megarefit's classifier on the wrapped TE model (every parameter's role, no problem);
* :class:`~megarefit.online.trainer.lora_merge.MergedLoRA`'s served copies translated to HF by
  ``megatron_to_hf``: HF transformers' logits on them (CPU) against the TE model's own forward (GPU), and
  the merged tensors against Bridge's ``export_hf_weights(..., merge_adapter_weights=True)``;
* the adapter-only refit's PEFT tensors (``plan_lora_to_peft`` over the layout ``LoraPublisher`` reads)
  against Bridge's PEFT export;
* tests/bridge_lora_moe.py's GLM-4.5-style MoE on the TE decoder block spec with grouped experts
  (``moe_grouped_gemm``: ``TEGroupedMLP``, ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``),
  both wrappers, Bridge's default ``share_expert_adapters``: the merged weights against Bridge's export and
  HF's logits on them against the TE model's forward; and ``MergedLoRA``'s refusal of Bridge's per-expert
  (``share_expert_adapters=False``) and shared-outer (``experts_shared_outer_loras=True``) grouped adapters.

Usage: ``python tests/bridge_lora_te_gpu.py WORKDIR`` writes everything to ``WORKDIR/result.json`` and
prints the record line (:func:`summary`; docs/lora_te_h200.jsonl holds the runs);
``python tests/bridge_lora_te_gpu.py --from-json docs/lora_te_h200.jsonl`` prints the table in docs/lora.md.
Needs megatron-core 0.19.2, Megatron-Bridge 0.6.2, transformer-engine and a GPU (the table, none of them).
TF32: TE's GEMMs take it by default; ``NVIDIA_TF32_OVERRIDE=0`` (CUDA's switch) turns it off for a plain
fp32 forward, which the record line names.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _build_te_gpt(arch, *, seed: int = 1234, **_):
    """``build_gpt_model`` of tests/bridge_lora.py's cases on Megatron-Core's TE layer spec, on the GPU."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarefit.demo import megatron_cpu

    kwargs = megatron_cpu._base_config_kwargs(arch, ps)
    kwargs["use_cpu_initialization"] = False
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.padded_vocab_size,
                     max_sequence_length=arch.max_sequence_length, pre_process=True, post_process=True,
                     parallel_output=False, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=arch.rotary_base,
                     rotary_percent=arch.rotary_percent)
    return model.eval()


def _build_te_moe(arch, *, seed: int = 1234, **_):
    """``build_gpt_model`` of tests/bridge_lora_moe.py's cases on the TE decoder block spec, grouped experts."""
    import dataclasses

    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarefit.demo import megatron_cpu

    arch = dataclasses.replace(arch, moe_grouped_gemm=True)
    config, _ = megatron_cpu._transformer_config(arch, None)
    config.use_cpu_initialization = False
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.padded_vocab_size,
                     max_sequence_length=arch.max_sequence_length, pre_process=True, post_process=True,
                     parallel_output=False, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=arch.rotary_base,
                     rotary_percent=arch.rotary_percent)
    return model.eval()


def _moe(work: Path) -> dict:
    """The MoE cases (tp 1, ep 1), and the grouped adapters MergedLoRA refuses."""
    import bridge_lora_moe as moe
    import transformers

    from megarefit.demo import megatron_cpu
    from megarefit.integrations.hf import save_checkpoint

    megatron_cpu.build_gpt_model = _build_te_moe
    config = transformers.AutoConfig.for_model(**moe.CFG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "hf", safe_serialization=True)

    def hf_model_of(state: dict) -> torch.nn.Module:  # as tests/bridge_lora_moe.py's
        save_checkpoint(work / "merged", moe.CFG, state)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(work / "merged", output_loading_info=True,
                                                                        dtype=torch.float32)
        assert not any(info.values()), info
        return model.eval()

    out: dict = {}
    for wrapper in ("lora", "canonical_lora"):
        key = f"moe-{wrapper}-tp1"
        moe.CASES[key] = (wrapper, 1, 1, 1)
        case = _guarded(moe._case, wrapper, 1, str(work))
        out[key] = case if "error" in case else _guarded(moe._compare, key, [{key: _to_cpu(case)}], hf_model_of)
    for option in ("share_expert_adapters", "experts_shared_outer_loras"):
        out[f"moe-refused-{option}"] = _guarded(_grouped_refusal, option)
    return out


def _grouped_refusal(option: str) -> dict:
    """MergedLoRA on the TE MoE wrapped with Bridge's per-expert / shared-outer grouped adapters: the refusal."""
    import bridge_lora_moe as moe
    from megatron.bridge.peft.lora import LoRA

    from megarefit.demo import megatron_cpu
    from megarefit.errors import UnsupportedAdapterError
    from megarefit.online.trainer.lora_merge import MergedLoRA

    wrap = LoRA(dim=moe.RANK, alpha=moe.ALPHA, **{option: option != "share_expert_adapters"})
    model = wrap(_build_te_moe(megatron_cpu.gpt_arch_from_hf(moe.CFG, tp=1), seed=0), training=False)
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if ".layers.1.mlp.experts." in n and ".adapter." in n}
    try:
        MergedLoRA.from_megatron(model, moe.CFG)
        return {"refusal": None, "adapter_shapes": shapes}
    except UnsupportedAdapterError as exc:
        return {"refusal": str(exc), "adapter_shapes": shapes}


def summary(result: dict, *, tf32: bool, date: str) -> dict:
    """The record line of one run's ``result`` (what :func:`main` returns): versions, and per case the counts of
    differing names / tensors against Bridge, the largest merged difference, the logits' difference against HF
    transformers (CPU, fp32) and the largest |logit|; for the dense cases the TE modules' rows and layer 0's
    wrapped parameters with their module classes; the grouped adapters' refusals."""
    line = {k: result[k] for k in ("gpu", "torch", "transformer_engine", "megatron_core", "bridge")}
    line.update(tf32=tf32, date=date, cases={})
    for key, case in result.items():
        if key.startswith("moe-refused-"):
            line["cases"][key] = {"refusal": (case.get("refusal") or "")[:400], "error": case.get("error", "")[-300:],
                                  "factor_ndims": sorted({len(s) for s in case.get("adapter_shapes", {}).values()})}
        elif key.endswith("-tp1"):
            line["cases"][key] = {"error": case["error"][-300:]} if "error" in case else _case_line(key, case, result)
    return line


def _case_line(key: str, case: dict, result: dict) -> dict:
    counted = [k for k in ("merged_names_differ", "merged_bytes_differ", "peft_names_differ", "peft_bytes_differ",
                           "planned_names_differ", "planned_bytes_differ") if k in case]
    line = {**{k: len(case[k]) for k in counted}, "merged_max_abs_diff": case["merged_max_abs_diff"],
            "logits_diff": case["logits_diff"], "logits_max_abs": case["logits_max_abs"]}
    if key.startswith("moe-"):
        return {**line, "classified": len(case["classified"]), "problems": sum(bool(c[3]) for c in case["classified"]),
                "grouped_adapters": {n: s for n, s in case["adapter_shapes"].items() if ".mlp.experts." in n}}
    probe = result[f"probe-{key.removesuffix('-tp1')}"]
    return {**line, "classified": len(probe["classified"]), "problems": sum(bool(c[3]) for c in probe["classified"]),
            "te_rows": sorted({f"{c[1]}:{c[2]}" for c in probe["classified"] if c[1].startswith("TE")}),
            # the wrapped linears of layer 0 as classified (name -> module class): tests/test_lora.py's
            # stand-in of the TE spelling is checked against these
            "wrapped": {c[0]: c[1] for c in probe["classified"]
                        if ".layers.0." in c[0] and (".to_wrap." in c[0] or ".adapter." in c[0])}}


def table(path: Path) -> str:
    """The markdown tables of the record lines in ``path``: the dense cases, the MoE cases, the refusals."""
    rows = [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
    first = rows[0]
    bar = r"\|"
    out = [(f"Bridge {first['bridge']} on megatron-core {first['megatron_core']}, Transformer Engine "
            f"{first['transformer_engine']}, torch {first['torch']}, one {first['gpu']}, tp 1, ep 1, fp32, "
            f"{first['date']} (by hand: tests/bridge_lora_te_gpu.py). Differing: tensors whose names or bytes "
            "differ from Bridge's export, merged (HF) and PEFT (lora_to_peft and the adapter-only plan). Logits: "
            "the TE model's forward (GPU) against HF transformers (CPU) on megarefit's merged weights. Classified: "
            "dense, the parameters of layer 0 and outside the layers; MoE, every adapter (problems: of every "
            "parameter)."), "",
           (f"| model | wrapper | TF32 | classified (problems) | merged differing | PEFT differing "
            f"| max {bar}logits diff{bar} | max {bar}logit{bar} |"),
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        tf32 = "on (default)" if row["tf32"] else "off"
        for key, c in row["cases"].items():
            model, wrapper = ("GLM-4.5-style MoE", key[4:]) if key.startswith("moe-") else ("Qwen3 dense", key)
            if key.startswith("moe-refused-"):
                continue
            if "error" in c:
                out.append(f"| {model} | {wrapper.removesuffix('-tp1')} | {tf32} | error | | | | |")
                continue
            peft = sum(c.get(k, 0) for k in ("peft_names_differ", "peft_bytes_differ", "planned_names_differ",
                                             "planned_bytes_differ"))
            out.append(f"| {model} | {wrapper.removesuffix('-tp1')} | {tf32} | {c['classified']} ({c['problems']}) "
                       f"| {c['merged_names_differ'] + c['merged_bytes_differ']} "
                       f"| {peft if 'peft_names_differ' in c else '-'} | {c['logits_diff']:.1e} "
                       f"| {c['logits_max_abs']:.2f} |")
    te_rows = sorted({r for row in rows for c in row["cases"].values() for r in c.get("te_rows", [])})
    refused = {k.removeprefix("moe-refused-"): c for k, c in first["cases"].items() if k.startswith("moe-refused-")}
    out += ["", "Dense TE modules' parameters classified as: " + ", ".join(f"`{r}`" for r in te_rows) + ".", ""]
    out += [f"- Bridge's `{k}={k != 'share_expert_adapters'}` (factors {', '.join(f'{n}-D' for n in c['factor_ndims'])}):"
            f" {'refused' if c['refusal'] else 'NOT refused'}, \"{c['refusal'].split(': ', 1)[-1][:90]}...\""
            for k, c in refused.items()]
    return "\n".join(out)


def _perturb_on_cpu(perturb):
    def run(model, **kwargs):
        model.cpu()
        perturb(model, **kwargs)
        model.cuda()
    return run


@torch.no_grad()
def _forward_gpu(model, tokens):
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(batch, seq)
    out = model(tokens.cuda(), position_ids.cuda(), attention_mask=None)  # TE's spec: causal by mask type
    return out.float().cpu()


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_cpu(v) for v in x]
    return x


def _te_classes(model) -> dict[str, str]:
    return {n: type(m).__module__ + "." + type(m).__name__ for n, m in model.named_modules()
            if ".layers.0." in n and n.count(".") <= 6}


def main(work: Path) -> dict:
    import transformer_engine
    import transformers
    from bridge_lora import CFG, WRAPPERS, _case, _compare
    from megatron.core import parallel_state as ps

    from megarefit.demo import megatron_cpu
    from megarefit.integrations.bridge import _import_bridge

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    with socket.socket() as s:  # a free port for the one-process group's store, on loopback only
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    _import_bridge()
    import megatron.bridge.peft.utils as peft_utils

    assert peft_utils.HAVE_TE, "Bridge does not see Transformer Engine"
    megatron_cpu.build_gpt_model = _build_te_gpt
    megatron_cpu.forward_logits = _forward_gpu
    megatron_cpu.perturb_parameters_ = _perturb_on_cpu(megatron_cpu.perturb_parameters_)

    config = transformers.AutoConfig.for_model(**CFG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "hf", safe_serialization=True)

    def hf_model_of(state: dict) -> torch.nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state), (missing, unexpected)
        return model

    from importlib.metadata import version

    out: dict = {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0), "megatron_core": version("megatron-core"),
                 "bridge": version("megatron-bridge")}
    for wrapper in WRAPPERS:  # first what the wrapped TE model is: its names and their classification
        out[f"probe-{wrapper}"] = _guarded(_probe, wrapper)
    ranks = {}
    for wrapper in WRAPPERS:
        case = _guarded(_case, wrapper, 1, str(work))
        if "error" in case:
            out[f"{wrapper}-tp1"] = case
        else:
            ranks[f"{wrapper}-tp1"] = _to_cpu(case)
    with torch.no_grad():
        for key in ranks:
            out[key] = _guarded(_compare, key, [ranks], hf_model_of)
        out.update(_moe(work / "moe"))
    return out


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or its traceback: one run on the lent GPU reports every stage it reaches."""
    import traceback

    try:
        return fn(*args)
    except Exception:  # noqa: BLE001  (reported, not handled)
        return {"error": traceback.format_exc()[-4000:]}


def _probe(wrapper: str) -> dict:
    """The Bridge-wrapped TE model's parameters (layer 0 and the rest), module classes and classification."""
    from bridge_lora import ALPHA, CFG, RANK
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA

    from megarefit.demo import megatron_cpu
    from megarefit.layout.classify import classify_model
    from megarefit.layout.dims import ModelDims

    model = _build_te_gpt(megatron_cpu.gpt_arch_from_hf(CFG, tp=1), seed=0)
    model = (LoRA if wrapper == "lora" else CanonicalLoRA)(dim=RANK, alpha=ALPHA)(model, training=False)
    classified = classify_model(model, ModelDims.from_hf_config(CFG))
    return {"params": {n: list(p.shape) for n, p in model.named_parameters() if ".layers.1." not in n},
            "state_only": sorted(n for n in model.state_dict() if ".layers.1." not in n
                                 and n not in dict(model.named_parameters())),
            "modules": _te_classes(model),
            "classified": [(c.name, c.module_class, c.role and c.role.value, c.problem) for c in classified
                           if ".layers.1." not in c.name]}


if __name__ == "__main__":
    if sys.argv[1] == "--from-json":
        print(table(Path(sys.argv[2])))
    else:
        import datetime
        import os

        work = Path(sys.argv[1])
        work.mkdir(parents=True, exist_ok=True)
        result = main(work)
        (work / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(summary(result, tf32=os.environ.get("NVIDIA_TF32_OVERRIDE") != "0",
                                 date=datetime.date.today().isoformat())))
