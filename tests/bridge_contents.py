"""Run by tests/test_bridge.py inside the Megatron-Bridge environment: the same HF checkpoint
loaded into the same real Megatron-Core model (Qwen3-style, TP=2, two gloo processes on
CPU) by Bridge 0.3.1 (``AutoBridge.load_hf_weights``) and by megarefit
(``hf_to_megatron``); Megatron's forward logits of each vs HF transformers' logits of the
checkpoint, and Bridge's own export (``export_hf_weights``) after each load.

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


def config() -> dict:
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / "Qwen3-0.6B.json").read_text())
    cfg.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
               intermediate_size=96, num_hidden_layers=2, rope_scaling=None, max_position_embeddings=256,
               tie_word_embeddings=False, torch_dtype="float32")
    return cfg


def job(rank: int, world_size: int, master_port: int, ckpt: str) -> dict:
    import safetensors.torch

    from megarefit import hf_to_megatron
    from megarefit.integrations.bridge import _import_bridge
    from megarefit.integrations.megatron import refit_tensors
    from megarefit.demo.megatron_cpu import apply_cpu_patches, build_gpt_model, forward_logits, gpt_arch_from_hf, init_parallel

    apply_cpu_patches()
    cfg = config()
    init_parallel(rank=rank, world_size=world_size, master_port=master_port, tp=2, pp=1)
    model = build_gpt_model(gpt_arch_from_hf(cfg, tp=2), seed=0)
    _import_bridge()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(ckpt, torch_dtype=torch.float32)
    bridge.load_hf_weights([model])
    out: dict = {"bridge_logits": forward_logits(model, TOKENS)}
    try:
        out["bridge_export"] = {k: v.detach().clone() for k, v in
                                bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["bridge_export"] = f"{type(exc).__name__}: {exc}"
    hf_state = safetensors.torch.load_file(str(Path(ckpt) / "model.safetensors"))
    params = refit_tensors(model)
    with torch.no_grad():
        for name, t in hf_to_megatron(hf_state, cfg, tp=2)[(rank, 0, 0)].items():
            params[name].copy_(t)
    out["megarefit_logits"] = forward_logits(model, TOKENS)
    out["bridge_export_of_megarefit_load"] = {k: v.detach().clone() for k, v in  # Bridge's export on its own
                                              bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    return out


def main(work: Path) -> dict:
    import safetensors.torch
    import transformers

    from megarefit.demo.workers import run_workers

    cfg = config()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms away from 1 so a swapped or skipped tensor shows
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(work, safe_serialization=True)
    hf_state = safetensors.torch.load_file(str(work / "model.safetensors"))
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits.float()
    ranks = run_workers(job, world_size=2, args=(str(work),), timeout=600)
    rank0 = ranks[0]

    def diff(logits: torch.Tensor | None) -> float:
        return float((logits[..., :256].float() - want).abs().max())

    def mismatched(export: dict | str) -> list[str] | str:
        if isinstance(export, str):
            return export
        return sorted(k for k in hf_state if k not in export or not torch.equal(export[k].float(), hf_state[k]))

    return {"hf_max_abs": float(want.abs().max()), "bridge_logits_diff": diff(rank0["bridge_logits"]),
            "megarefit_logits_diff": diff(rank0["megarefit_logits"]),
            "bridge_export_mismatched": mismatched(rank0["bridge_export"]),
            "bridge_export_of_megarefit_load_mismatched": mismatched(rank0["bridge_export_of_megarefit_load"])}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
