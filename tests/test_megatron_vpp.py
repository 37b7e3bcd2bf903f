"""Megatron-Core's interleaved (virtual) pipeline is a plain pipeline of pp * vpp stages.

Two processes (pp=2) each build both model chunks of a real Megatron-Core GPTModel with
``virtual_pipeline_model_parallel_size=2`` on CPU. Every chunk's parameter names and
shapes must equal what megarefit's layout places on stage
``virtual_stage(pp_rank, vp_stage, pp)`` of a pp=4 pipeline, and every layer parameter's
global layer there must equal the ``layer_number`` Megatron itself gave its layer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from conftest import tiny_config  # noqa: E402
from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.layout import virtual_stage  # noqa: E402
from megarefit.layout.geometry import source_tensors  # noqa: E402
from megatron_jobs import vpp_layout_job  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("tied", [True, False])
def test_vpp_chunks_are_virtual_stages(tied):
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=8, tie_word_embeddings=tied)
    pp, vpp = 2, 2
    per_rank = run_workers(vpp_layout_job, world_size=2, args=(cfg, pp, vpp), timeout=600)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=1, pp=pp * vpp, padded_vocab_size=dims.padded_vocab_size(1), num_layers=8,
                                megatron=harness_megatron())
    want = source_tensors(dims, layout)
    seen = set()
    for chunks in per_rank:
        for vp_stage, chunk in chunks.items():
            stage = virtual_stage(chunk["pp"], int(vp_stage), pp)
            seen.add(stage)
            expected = want[(0, stage, 0)]
            assert {n: shape for n, (shape, _) in chunk["params"].items()} == {n: t.shape for n, t in expected.items()}
            for name, (_, layer) in chunk["params"].items():
                assert layer == expected[name].layer, (stage, name)
    assert seen == {0, 1, 2, 3}
