"""Block-FP8 vLLM-sharded targets against vLLM's own FP8 layers.

vLLM builds FP8 models (Qwen3 dense, Qwen3-MoE, DeepSeek-V3 MLA, MiniMax-M2) from the config megarefit
writes, in two real tensor-parallel processes on CPU, with expert parallelism off and on,
and fills them with its own ``load_weights`` from an FP8 checkpoint made by vLLM's own
``per_block_cast_to_fp8`` (independent of megarefit). megarefit plans the trainers' shards
straight into each worker's FP8 parameters -- ``qkv_proj.weight`` + ``weight_scale_inv``,
``w13_weight_scale_inv`` [E_l, 2*I_p/128, H/128], ``fused_qkv_a_proj`` with a partial edge
block, ... -- quantized by the trainers where their shards hold whole blocks and by the
receiver where blocks straddle trainer shards (the plan says which). Every parameter must
come out bit-identical. On a CPU without AMX tiles vLLM's FP8 matmul kernel is not picked (it needs
them; no forward runs here: ``vllm_loader_jobs.fp8_linear_kernels_unpicked``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import megarefit  # noqa: E402
from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.quant import Fp8Format, quantization_config, quantized_weight_names  # noqa: E402
from megarefit.quant.planning import where_quantized  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from fp8_checks import fp8_refit, same_as_vllm  # noqa: E402
from moe_cases import moe_config  # noqa: E402
from reference import hf_checkpoint_state, vllm_fp8_checkpoint  # noqa: E402
from vllm_loader_jobs import unportable, vllm_model_job  # noqa: E402

from conftest import tiny_config  # noqa: E402

CASES = {  # name: (config, trainer layouts (tp, ep, etp, expert layout, layer spec), where each is quantized)
    "qwen3": (lambda: tiny_config("Qwen3-0.6B", hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=128, intermediate_size=768, vocab_size=300, tie_word_embeddings=False),
              [(2, 1, 2, "sequential", "local", "trainer"),  # q/k/v rows per query group 256 / 128 / 128, ffn 384
               (4, 1, 4, "sequential", "local", "both")]),  # ffn rows per trainer rank 192: the MLP on the receiver
    "qwen3_moe": (lambda: moe_config("Qwen3-30B-A3B", hidden_size=256, head_dim=128, num_key_value_heads=4,
                                     moe_intermediate_size=768, intermediate_size=512),
                  [(2, 2, 1, "te_grouped", "local", "trainer"),  # whole experts on the trainers
                   (4, 1, 4, "sequential", "local", "both")]),  # expert rows per trainer rank 192: on the receiver
    "deepseek_v3": (lambda: moe_config("DeepSeek-V3", hidden_size=256, moe_intermediate_size=256,
                                       intermediate_size=512, q_lora_rank=128, kv_lora_rank=128,
                                       qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64),
                    [(2, 2, 1, "te_grouped", "te", "trainer"),  # TE spec: MLA down-projections whole on every rank
                     (2, 2, 1, "te_grouped", "local", "both")]),  # local spec: q_lora 128 split in 64-row halves
    # q / k norms over all heads (unquantized, split by heads), the router gate unquantized and made in fp32
    "minimax_m2": (lambda: moe_config("MiniMax-M2.5", hidden_size=256, head_dim=128, num_key_value_heads=2,
                                      intermediate_size=256, rotary_dim=64, use_mtp=False, num_mtp_modules=0),
                   [(2, 2, 1, "te_grouped", "te", "trainer")]),  # q/k/v per rank 256 / 128 / 128 rows, ffn 256
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cases, states = {}, {}
    for key, (make, _) in CASES.items():
        cfg = make()
        dims = ModelDims.from_hf_config(cfg)
        hf = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)  # that one stays fp32
              for k, v in hf_checkpoint_state(cfg, tmp_path_factory.mktemp(key), 9).items()}
        states[key] = (cfg, hf)
        fp8_cfg = cfg | {"quantization_config": quantization_config(dims, Fp8Format())}
        for ep in (False, True):
            if ep and not dims.num_experts:
                continue
            cases[f"{key}-ep{int(ep)}"] = (fp8_cfg, vllm_fp8_checkpoint(hf, quantized_weight_names(dims)), ep)
    per_rank = run_workers(vllm_model_job,
                           start_method="spawn", world_size=2, args=(cases, str(tmp_path_factory.mktemp("vllm"))),
                           timeout=600)
    got = {k: [({n: unportable(t) for n, t in per_rank[r][k][0].items()}, per_rank[r][k][1]) for r in range(2)]
           for k in cases}
    return states, got


@pytest.mark.parametrize("key", list(CASES))
def test_fp8_shards_equal_vllm_fp8_layers(models, key):
    states, vllm_models = models
    cfg, hf = states[key]
    dims = ModelDims.from_hf_config(cfg)
    family = dims.family
    fmt = Fp8Format()
    for tp, ep, etp, expert_layout, layer_spec, where in CASES[key][1]:
        if family in ("qwen3", "qwen3_moe"):
            shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, expert_layout=expert_layout)
        else:
            shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, layer_spec=layer_spec,
                                              expert_layout=expert_layout)
        layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
        for expert_parallel in ((False, True) if dims.num_experts else (False,)):
            for rank in range(2):
                want, maps = vllm_models[f"{key}-ep{int(expert_parallel)}"][rank]
                expert_map = next(iter(maps.values())) if expert_parallel else None
                target = VllmTarget(2, rank, expert_parallel=expert_parallel, expert_map=expert_map)
                plan, got = fp8_refit(dims, layout, target, shards, fmt)
                at = f"{key} trainer tp={tp} ep={ep} etp={etp} {layer_spec}, vLLM rank {rank} EP {expert_parallel}"
                want = {n: t for n, t in want.items() if not n.endswith(("_scale", ".k_scale", ".v_scale"))}
                assert got.keys() == want.keys(), (at, sorted(got.keys() ^ want.keys())[:6])
                for name, tensor in want.items():
                    assert same_as_vllm(got[name], tensor), (name, at)
                kinds = {"trainer" if w == "trainer" else "receiver" for w in where_quantized(plan).values()}
                assert kinds == ({"trainer", "receiver"} if where == "both" else {where}), (at, kinds)
