"""Worker body for the DeepSeek-V4 vLLM oracle (module level so spawn can import it): vLLM's own
``DeepseekV4ForCausalLM`` (its CPU build, ``vllm/models/deepseek_v4/cpu/model.py``) constructed by
``initialize_model`` in real tensor-parallel processes on CPU (gloo), filled by its own ``load_weights``
from full checkpoint tensors under DeepSeek-native names (``dsv4_cases.dsv4_checkpoint``). No forward
pass runs and no ``process_weights_after_loading``: what comes back is the checkpoint-format shard each
rank holds.

Run it as the other vLLM jobs run::

    run_workers(vllm_dsv4_model_job, start_method="spawn", world_size=2, args=(cases, workdir), timeout=600)

What rank ``t`` of ``T`` holds (checked bit for bit against cat / chunk of the checkpoint at T = 1 and 2,
expert parallelism off and on, float32 and bfloat16; names after vLLM's mapper, cpu/model.py:797-844:
``layers.`` -> ``model.layers.``, ``embed.weight`` -> ``model.embed_tokens.weight``, ``head.weight`` ->
``lm_head.weight``, ``norm.`` -> ``model.norm.``, ``hc_head_*`` -> ``model.hc_head_*``, ``mtp.*`` dropped):

* whole: ``hc_*``, ``attn_norm`` / ``ffn_norm`` / ``norm``, ``attn.q_norm`` / ``kv_norm``, ``ffn.gate.weight``,
  ``ffn.gate.tid2eid``, ``ffn.gate.bias`` (as ``ffn.gate.e_score_correction_bias``), and, under
  ``attn.compressor.`` / ``attn.indexer.compressor.``, ``ape``, ``norm.weight`` and ``fused_wkv_wgate.weight``
  = cat(``wkv``, ``wgate``) (rows), ``attn.indexer.wq_b`` / ``weights_proj``; ``attn.fused_wqa_wkv.weight``
  = cat(``wq_a``, ``wkv``) (rows);
* rows chunk ``t``: ``attn.wq_b`` (heads), ``attn.wo_a`` (groups), ``attn.attn_sink`` (heads);
  ``ffn.shared_experts.gate_up_proj.weight`` = cat(``w1`` rows chunk t, ``w3`` rows chunk t);
* columns chunk ``t``: ``attn.wo_b``, ``ffn.shared_experts.down_proj.weight`` (``w2``);
* vocab rows chunk ``t`` of the vocab padded to a multiple of 64 (zero rows past it): ``embed_tokens``,
  ``lm_head``;
* routed experts ``ffn.experts.routed_experts.w13_weight`` [E_local, 2*I/T', H] = per local expert
  cat(``w1`` rows chunk, ``w3`` rows chunk) and ``w2_weight`` [E_local, H, I/T'] = ``w2`` columns chunk:
  without EP every expert, chunk ``t`` of T' = T; with EP (linear placement) experts ``[t*E/T, (t+1)*E/T)``
  whole (T' = 1).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm_loader_jobs import fp8_linear_kernels_unpicked, init_vllm_tp, model_config_for, portable


def vllm_dsv4_model_job(rank: int, world_size: int, port: int,
                        cases: dict[str, tuple[dict, dict[str, torch.Tensor], bool]],
                        workdir: str) -> dict[str, Any]:
    """Per case ``(hf config, checkpoint tensors, enable_expert_parallel)``: vLLM's DeepSeek-V4 built at
    tensor parallel ``world_size`` (expert parallel over the same ranks when asked), in the config's
    ``torch_dtype`` (float32 when it has none), filled by ``model.load_weights``. Returns per case
    ``(tensors, expert_maps, loaded)``: ``tensors`` this rank's ``named_parameters()`` and the named buffers
    ``load_weights`` reports it filled (none in vLLM 0.32: ``ffn.gate.tid2eid`` is a parameter), each
    cloned (``portable`` for pickling); ``expert_maps`` each routed-experts layer's ``_expert_map`` as a
    list (global expert -> local slot, -1 where another rank holds it; absent without EP); ``loaded``
    the sorted names ``load_weights`` returned (the checkpoint's ``mtp.*`` tensors are dropped by vLLM's
    CPU mapper and name nothing)."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    init_vllm_tp(rank, world_size, port)
    build_dsv4_attention_on_cpu()
    if any(cfg.get("quantization_config") for cfg, _, _ in cases.values()):
        fp8_linear_kernels_unpicked()  # block-FP8 layers without their AMX matmul kernel (no forward runs)
    out: dict[str, Any] = {}
    for key, (cfg, hf, expert_parallel) in cases.items():
        dtype = cfg.get("torch_dtype") or "float32"
        model_config = model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}"), dtype)
        config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(
            tensor_parallel_size=world_size, enable_expert_parallel=expert_parallel))
        # in the model dtype, as vLLM's loader builds it (model_loader/base_loader.py:73): the parameters that
        # name no dtype of their own take the default one
        with set_current_vllm_config(config), set_default_torch_dtype(model_config.dtype):
            model = initialize_model(vllm_config=config)
            # copies: loaders may write into or narrow the tensors they get, which share memory with the parent's
            loaded = set(model.load_weights((n, t.clone()) for n, t in hf.items()))
        tensors = {n: portable(p.detach().clone()) for n, p in model.named_parameters()}
        tensors |= {n: portable(b.detach().clone()) for n, b in model.named_buffers() if n in loaded}
        maps = {n: m._expert_map.tolist() for n, m in model.named_modules()
                if isinstance(getattr(m, "_expert_map", None), torch.Tensor)}
        out[key] = (tensors, maps, sorted(loaded))
    return out


def build_dsv4_attention_on_cpu() -> None:
    """Let vLLM *construct* DeepSeek-V4's attention on CPU outside a vLLM CPU worker.

    ``DeepseekV4Attention.__init__`` (``vllm/models/deepseek_v4/attention.py:330``) and the indexer it
    builds on ratio-4 layers, ``DeepseekV4Indexer.__init__`` (attention.py:1049-1052), create
    ``torch.cuda.Event()`` objects for their aux-stream overlap; on a CPU-only torch that raises
    ``RuntimeError: Tried to instantiate dummy base class Event``. A vLLM CPU worker never sees it, as
    ``vllm/v1/worker/cpu_worker.py`` imports ``vllm/v1/worker/cpu/shm.py``, which replaces
    ``torch.cuda.Event`` process-wide (shm.py:62); these jobs build the model without a worker. So only
    while ``DeepseekV4CPUAttention.__init__`` runs (``cpu/cpu_sparse.py:273``, the class the CPU model
    builds; its base builds the indexer inside it), ``torch.cuda.Event`` is vLLM's own CPU stand-in
    ``_NoOpEvent`` (cpu_sparse.py:177: "since CPU never sets an aux stream list, these events are
    constructed but never actually used"), the same swap vLLM's XPU attention makes
    (``xpu/xpu_sparse.py:47-56``). Parameters, their names, shapes and dtypes and ``load_weights``
    stay vLLM's own. Idempotent: the wrapper is installed once per process."""
    from vllm.models.deepseek_v4.cpu import cpu_sparse

    cls = cpu_sparse.DeepseekV4CPUAttention
    if getattr(cls.__init__, "_megarefit_noop_events", False):
        return
    original = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        event = torch.cuda.Event
        torch.cuda.Event = cpu_sparse._NoOpEvent  # type: ignore[misc,assignment]
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.Event = event  # type: ignore[misc]

    __init__._megarefit_noop_events = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


__all__ = ["build_dsv4_attention_on_cpu", "vllm_dsv4_model_job"]
