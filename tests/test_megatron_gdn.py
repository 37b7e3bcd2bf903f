"""Qwen3.5's and Qwen3-Next's gated DeltaNet and gated attention on real Megatron-Core (CPU, gloo; every verified
release ships ``GatedDeltaNet``: run here on the pinned 0.16.1 and in test_megatron_0_19.py's child on 0.19.2).

megarefit's HF -> Megatron shards of a transformers ``Qwen3_5ForCausalLM`` go into Megatron-Core's
own ``GatedDeltaNet`` and ``SelfAttention(attention_output_gate=True)`` at TP 2 (see
tests/gdn_jobs.py for what lets them run on CPU); their outputs must equal the HF layers' on the
same input. This is what fixes the layouts independently of Megatron-Bridge: ``in_proj``'s
per-rank [Q; K; V; Z; b; a], ``conv1d``'s per-rank [Q; K; V], the per-group [q heads; gate heads;
k; v] of ``linear_qkv``, and the zero-centered ``out_norm`` (HF w = Megatron w + 1); for
Qwen3-Next, HF's per-key-head packing of ``in_proj_qkvz`` / ``in_proj_ba`` too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from test_qwen3_next import NEXT, next_state  # noqa: E402
from test_qwen35 import hf_state, tiny  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("tp", [2])  # tp 1 passes too (run by hand); tp 2 holds every cut
def test_megatron_layers_loaded_from_the_plan_equal_hfs(tp, model, tmp_path):
    from gdn_jobs import gdn_layers_job

    import megatron.core

    from megarefit.demo.workers import run_workers
    from megarefit.specs.megatron_core import MegatronCore
    from megarefit.translate import hf_to_megatron

    if model == "qwen3_5":
        cfg = tiny(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
        hf = hf_state(cfg)
    else:
        cfg = NEXT | {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "head_dim": 16,
                      "num_attention_heads": 8}
        hf = {k: v for k, v in next_state(cfg, tmp_path).items() if "mtp" not in k}
    # the trainer Megatron-Bridge configures (zero-centered norms, the output gate): the jobs' norms
    # compute TENorm's zero-centered (1 + w), which is assumed here, not tested
    shards = hf_to_megatron(hf, cfg, tp=tp, megatron=MegatronCore.verified(megatron.core.__version__))
    for rank, diffs in enumerate(run_workers(gdn_layers_job, world_size=tp, args=(cfg, hf, shards), timeout=600)):
        for layer, (diff, scale) in diffs.items():  # float32 rounding; a wrong layout is off by O(scale)
            assert scale > 0.05 and diff <= 1e-6 * scale, (rank, layer, diff, scale)
