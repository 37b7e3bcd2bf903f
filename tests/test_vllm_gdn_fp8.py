"""Block FP8 for the gated-DeltaNet families (Qwen3.5 dense and MoE, Qwen3-Next) against vLLM's own FP8 models.

vLLM builds them from the config megarefit writes (``quantization_config`` with its ``modules_to_not_convert``)
in two real tensor-parallel processes on CPU, expert parallelism off and on, and fills them with its own
``load_weights`` from an FP8 checkpoint quantized by vLLM's own ``per_block_cast_to_fp8`` (independent of
megarefit). As vLLM and Qwen's FP8 checkpoints do, the GDN's ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_qkvz`` and ``out_proj`` are FP8 and its ``in_proj_b`` / ``in_proj_a`` / ``in_proj_ba`` ("ba_proj
doesn't support blockwise fp8"), ``conv1d``, the router and shared-expert gates stay bf16. megarefit plans
the trainers' shards straight into each worker's parameters: every FP8 byte and ``weight_scale_inv`` must
come out bit-identical, every other parameter equal. A trainer's ``in_proj`` shard feeds both kinds, so the
FP8 parts are quantized on the receiver (the plan says why); everything else on the trainers. Dims are
multiples of vLLM's 128 blocks per rank (vLLM checks that at tp 2).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from fp8_checks import fp8_refit, same_as_vllm  # noqa: E402
from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.quant import Fp8Format, quantization_config, quantized_weight_names  # noqa: E402
from megarefit.quant.planning import where_quantized  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from megarefit.translate import hf_to_megatron  # noqa: E402
from reference import hf_checkpoint_state, vllm_fp8_checkpoint  # noqa: E402

DENSE = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
         "intermediate_size": 256, "vocab_size": 300, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "full_attention_interval": 2, "tie_word_embeddings": False}
MOE = DENSE | {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_experts": 4,
               "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "num_experts_per_tok": 2}
NEXT = MOE | {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
CONFIGS = {"qwen3_5": DENSE, "qwen3_5_moe": MOE, "qwen3_next": NEXT}
FMT = Fp8Format()


def _state(cfg: dict, directory) -> dict[str, torch.Tensor]:
    """bf16 tensors under transformers' names; norm weights in [0.5, 2) (where the gated norm's +1 is exact)."""
    return {k: (v.abs() % 1.5 + 0.5 if "norm" in k else v * 0.02).to(torch.bfloat16)
            for k, v in hf_checkpoint_state(cfg, directory).items() if not k.startswith("mtp.")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vllm_loader_jobs import unportable, vllm_qwen35_model_job

    states, cases = {}, {}
    for key, cfg in CONFIGS.items():
        dims = ModelDims.from_hf_config(cfg)
        hf = states[key] = _state(cfg, tmp_path_factory.mktemp(key))
        fp8 = cfg | {"quantization_config": quantization_config(dims, FMT)}
        ckpt = vllm_fp8_checkpoint(hf, quantized_weight_names(dims))
        for ep in ((False, True) if dims.num_experts else (False,)):
            cases[f"{key}-ep{int(ep)}"] = (fp8, ckpt, ep)
    per_rank = run_workers(vllm_qwen35_model_job, start_method="spawn", world_size=2,
                           args=(cases, str(tmp_path_factory.mktemp("vllm"))), timeout=600)
    return states, {k: [({n: unportable(t) for n, t in per_rank[r][k][0].items()}, per_rank[r][k][1])
                        for r in range(2)] for k in cases}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_fp8_shards_equal_vllm_fp8_models(models, key):
    states, vllm_models = models
    cfg, hf = CONFIGS[key], states[key]
    dims = ModelDims.from_hf_config(cfg)
    ep = 2 if dims.num_experts else 1
    for tp in (2, 1):
        shards = hf_to_megatron(hf, cfg, tp=tp, ep=ep)
        layout = SourceLayout.build(tp=tp, pp=1, ep=ep, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers)
        for expert_parallel in ((False, True) if dims.num_experts else (False,)):
            for rank in range(2):
                want, maps = vllm_models[f"{key}-ep{int(expert_parallel)}"][rank]
                target = VllmTarget(2, rank, expert_parallel=expert_parallel,
                                    expert_map=next(iter(maps.values())) if expert_parallel else None)
                plan, got = fp8_refit(dims, layout, target, shards, FMT)
                at = f"{key} trainer tp={tp} ep={ep}, vLLM rank {rank} EP {expert_parallel}"
                want = {n: t for n, t in want.items() if not n.endswith(("_scale", ".k_scale", ".v_scale"))}
                assert got.keys() == want.keys(), (at, sorted(got.keys() ^ want.keys())[:6])
                for name, tensor in want.items():
                    assert same_as_vllm(got[name], tensor), (name, at)
                ba = next(n for n in got if n.endswith(".linear_attn.in_proj_ba.weight"))
                assert got[ba].dtype != torch.float8_e4m3fn
                where = where_quantized(plan)
                gdn_in = {n: w for n, w in where.items() if ".linear_attn.in_proj_qkv" in n}
                assert gdn_in and all(w.startswith("receiver: ") and "also feeds a tensor kept in the model dtype"
                                      in w for w in gdn_in.values()), (at, gdn_in)
                assert "trainer" in where.values(), at
