"""Harness that builds REAL Megatron-Core ``GPTModel`` instances on CPU.

Used by the test-suite, the benchmarks and ``megarefit demo`` (what a user calls with their
own Megatron model is :mod:`megarefit.integrations.megatron`): every rank is a separate
process (see :func:`run_workers`) talking over a gloo process group, so
tensor (TP) and pipeline (PP) parallelism can be exercised without GPUs.

CPU recipe (verified with megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2; where releases differ,
the code says which does what):

* gloo default process group; ``parallel_state.initialize_model_parallel(tp, pp)``;
* ``use_cpu_initialization=True`` and fp32 params: Megatron initialises the
  full ("master") weight from the default torch RNG on every rank and keeps its
  own shard, so the same seed on every rank gives a deterministic model;
* all fusions off and dropout 0 (the fused kernels are CUDA/TE only);
* local (non-TransformerEngine) layer spec with RMSNorm;
* an inference RNG tracker instead of ``model_parallel_cuda_manual_seed``
  (which would touch CUDA generators);
* an explicit causal attention mask on every forward, because Megatron's
  default mask is allocated with ``device="cuda"``;
* the remaining CUDA assumptions are patched in :func:`apply_cpu_patches`
  (process-wide) and :func:`_no_tensor_cuda` (only while building a model).

``GPTModel(..., parallel_output=False)`` all-gathers the vocab-parallel logits,
so the last pipeline stage returns full-vocabulary logits on every TP rank.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from megarefit.demo.megatron_gdn import ZeroCenteredRMSNorm, gdn_config_kwargs, gdn_layer_specs, patch_gdn_cpu
from megarefit.errors import UnsupportedModelError
from megarefit.integrations.megatron import refit_tensors
from megarefit.specs.megatron_core import MegatronCore

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.models.gpt import GPTModel

    from megarefit.layout.dims import ModelDims

__all__ = ["GPTArch", "HARNESS_MODULE_MODES", "apply_cpu_patches", "bf16_adam_trainer", "build_gpt_model", "fake_grouped_gemm",
           "forward_logits", "full_dim_norms", "gpt_arch_from_hf", "harness_flags", "harness_megatron", "init_parallel",
           "megatron_series", "optimizer_on_cpu", "perturb_parameters_"]


@dataclass(frozen=True)
class GPTArch:
    """Architecture of a decoder-only GPT (Llama/Qwen style) as plain numbers."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head_dim; may differ from hidden_size // num_attention_heads (Qwen3)
    ffn_hidden_size: int
    padded_vocab_size: int  # already padded by the caller (divisible by tp)
    qkv_bias: bool = False
    qk_layernorm: bool = False
    full_qk_norm: bool = False  # the q/k norms run over all heads at once (MiniMax-M2; see full_dim_norms)
    tie_word_embeddings: bool = False
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # HF partial_rotary_factor (GLM-4.5: 0.5): RoPE on the first part of each head
    norm_epsilon: float = 1e-5
    max_sequence_length: int = 256
    # MoE (SequentialMLP experts, allgather dispatcher); num_experts=0 for dense models
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k (HF norm_topk_prob=False)
    dense_layers: tuple[int, ...] = ()  # global indices of dense layers in an MoE model
    moe_grouped_gemm: bool = False  # legacy GroupedMLP experts (layout inspection; see fake_grouped_gemm)
    shared_expert_ffn: int = 0
    router_score_function: str = "softmax"  # "sigmoid" for DeepSeek-V3
    router_expert_bias: bool = False  # DeepSeek-V3 noaux_tc score-correction bias (an fp32 buffer)
    router_topk_scaling_factor: float | None = None  # HF routed_scaling_factor
    # MLA (DeepSeek-V3 style); kv_lora_rank=0 for standard attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0  # HF qk_nope_head_dim
    qk_pos_emb_head_dim: int = 0  # HF qk_rope_head_dim
    v_head_dim: int = 0
    mtp_layers: int = 0  # Megatron mtp_num_layers (multi-token prediction on the last stage)
    first_stage_layers: int | None = None  # Megatron num_layers_in_first_pipeline_stage (uneven pipeline)
    last_stage_layers: int | None = None  # Megatron num_layers_in_last_pipeline_stage
    dtype: str = "float32"  # parameters and activations: "float32" or "bfloat16" (Megatron's bf16=True)
    # DSA lightning indexer (GLM-5; 0 heads: none): experimental_attention_variant="dsa"
    dsa_indexer_heads: int = 0
    dsa_indexer_head_dim: int = 0
    dsa_indexer_topk: int = 0
    # GLM-5.2: every dsa_indexer_topk_freq-th layer from the offset has its own indexer, the rest share
    # (Megatron-Core 0.19+); 1: every layer its own
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    # gpt-oss: biases on every linear (router too), learned attention sinks (softmax_type="learnable"),
    # clamped quick-GELU GLU with the linear half offset by 1, sliding-window layers, YaRN RoPE
    add_bias_linear: bool = False
    softmax_sinks: bool = False
    activation: str = "silu"  # or "quick_gelu" (x * sigmoid(1.702 x))
    glu_linear_offset: float = 0.0
    activation_clamp: float | None = None  # HF swiglu_limit
    sliding_window: int = 0  # HF sliding_window: tokens a sliding layer attends to, itself included (0: none)
    sliding_layers: tuple[bool, ...] = ()  # per layer (HF layer_types == "sliding_attention")
    # gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next; every verified release, see megatron_gdn): per layer True for
    # GatedDeltaNet, else gated full attention; the GDN dims as (HF / Megatron name, value) pairs
    gdn_linear: tuple[bool, ...] = ()
    gdn_dims: tuple[tuple[str, int], ...] = ()
    yarn: tuple[float, int, float, float] | None = None  # (factor, original_max_position_embeddings, beta_fast,
    #                                                    beta_slow), HF rope_type "yarn" with truncate=False


def megatron_series() -> tuple[int, int]:
    """(major, minor) of the installed ``megatron.core`` (imported)."""
    import megatron.core

    major, minor = megatron.core.__version__.split(".")[:2]
    return int(major), int(minor)


def harness_flags() -> dict[str, Any]:
    """The layout flags this harness sets beyond Megatron-Core's defaults, on the installed release:
    from 0.19 ``dsa_indexer_rope_interleaved=True`` (GLM-5's indexer ropes interleaved pairs, HF
    ``rope_interleave``, as Megatron-Bridge sets it; earlier releases always did)."""
    return {"dsa_indexer_rope_interleaved": True} if megatron_series() >= (0, 19) else {}


def harness_megatron() -> MegatronCore:
    """The :class:`~megarefit.specs.megatron_core.MegatronCore` record of the models this harness
    builds with the installed ``megatron.core``: its version, every flag as the spec tables need it for
    the model planned (:meth:`~megarefit.specs.megatron_core.MegatronCore.verified`; the harness builds
    each family so); a built model's own record is ``integrations.megatron.megatron_core_of(model)``.

    Raises:
        UnverifiedMegatronError: the installed version is not verified.
    """
    import megatron.core

    return MegatronCore.verified(megatron.core.__version__)


# --------------------------------------------------------------------------- CPU patches
_PATCHED = False


def apply_cpu_patches() -> None:
    """Apply every process-wide workaround needed to run Megatron-Core on CPU.

    Idempotent. All CPU hacks live here (plus the build-time-only
    :func:`_no_tensor_cuda`), so they are easy to audit:

    1. ``torch.cuda.current_device()`` is used by Megatron as a *device* argument
       in many places (buffers, RNG tracker, p2p helpers); returning ``"cpu"``
       makes those allocations land on the CPU instead of raising.
    2. Silence warnings that are pure noise for this harness (message-specific
       filters only): missing Apex/TransformerEngine (we use the local spec on
       purpose), the ``CUDA_DEVICE_MAX_CONNECTIONS`` hint of the TP linear layers,
       the default ``cuda_graph_scope`` deprecation, and torch's deprecation of
       ``all_gather_into_tensor`` (used by Megatron's logits gather).
    Call it before importing megatron so import-time warnings are filtered too.
    """
    global _PATCHED
    if _PATCHED:
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # 3. megatron.core.transformer.moe.moe_utils references Transformer-Engine names
    #    (te_general_gemm, fused_*) unconditionally; without TE they are undefined
    #    (NameError in the router). None is what they are when TE is absent.
    #    Applied after the import, in _patch_moe_utils().
    for msg in (
        r"(Transformer Engine and )?Apex (is|are) not installed",
        r".*CUDA_DEVICE_MAX_CONNECTIONS",
        r"full scope is deprecated",
        r".*all_gather_into_tensor.*is deprecated",
    ):
        warnings.filterwarnings("ignore", message=msg)
    _PATCHED = True


_MLA_ATTENTION: type | None = None


def _patch_mla() -> type:
    """MLA without Transformer Engine (megatron-core 0.16.1); parameter names unchanged.

    (a) ``multi_latent_attention`` believes TE is present but ``TELinear`` /
        ``TEColumnParallelLinear`` are mock placeholders, so an ``isinstance`` check
        raises: replace them with classes nothing is an instance of.
    (b) MLA passes ``k_channels`` / ``v_channels`` to its core attention, which the
        local ``DotProductAttention`` rejects (and sizes its output from
        ``kv_channels``): returns a subclass that takes them, for the layer specs.
    """
    global _MLA_ATTENTION
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name, None), type):
            setattr(mla, name, type(f"_No{name}", (), {}))
    if not isinstance(getattr(mla, "Linear", None), type):  # 0.17+ imports it only with TE
        from megatron.core.post_training.modelopt.layers import Linear

        mla.Linear = Linear
    if _MLA_ATTENTION is None:
        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                         **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if v_channels is not None:
                    self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
                    self.hidden_size_per_attention_head = v_channels

        _MLA_ATTENTION = MLADotProductAttention
    return _MLA_ATTENTION


def _duplicated_linear() -> type:
    """Megatron-Core's local replicated ``Linear`` (``post_training.modelopt.layers``, whole
    ``weight`` [out, in] on every rank, ``forward`` -> ``(y, None)``) taking the
    ``parallel_mode="duplicated"`` that the DSA indexer passes to TE's ``TELinear``."""
    from megatron.core.post_training.modelopt.layers import Linear

    class DuplicatedLinear(Linear):
        def __init__(self, *args: Any, parallel_mode: str | None = None, **kwargs: Any) -> None:
            if parallel_mode not in (None, "duplicated"):
                raise ValueError(f"DuplicatedLinear: parallel_mode {parallel_mode!r}")
            super().__init__(*args, **kwargs)

    return DuplicatedLinear


def full_dim_norms() -> tuple[type, type]:
    """``(q_layernorm, k_layernorm)`` module classes that RMS-normalize a token's whole query / key
    over all heads (HF MiniMax-M2's ``q_norm`` [heads*d] / ``k_norm`` [kv*d]), built as Megatron-Core's
    ``SelfAttention`` builds its q/k norms (``(hidden_size=head_dim, config, eps)``): the weight is
    this TP rank's heads' part ``[heads/tp * d]``, the sum of squares all-reduced over the TP group
    (Megatron-Bridge 0.6's ``FullDimQNorm`` / ``FullDimKNorm`` compute the same; tp must not exceed
    the kv heads here)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    class FullDimRMSNorm(torch.nn.Module):
        heads_attr = "num_attention_heads"

        def __init__(self, hidden_size: int, config: Any, eps: float = 1e-6) -> None:
            super().__init__()
            tp = config.tensor_model_parallel_size
            heads = getattr(config, self.heads_attr) or config.num_attention_heads
            if heads % tp:
                raise ValueError(f"{type(self).__name__}: {heads} heads do not split over tp={tp}")
            self.global_dim, self.eps = heads * hidden_size, eps
            self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)  # split over TP by heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [sq, b, heads/tp, d]
            flat = x.reshape(*x.shape[:2], -1).float()
            sq = flat.pow(2).sum(-1, keepdim=True)
            if ps.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
            y = flat * torch.rsqrt(sq / self.global_dim + self.eps)
            return (self.weight * y.to(x.dtype)).reshape(x.shape)

    class FullDimKNorm(FullDimRMSNorm):
        heads_attr = "num_query_groups"

    return FullDimRMSNorm, FullDimKNorm


# module classes of this harness for the classifier (``classify_model(overrides=...)``)
HARNESS_MODULE_MODES = {"DuplicatedLinear": "replicated", "FullDimRMSNorm": "column", "FullDimKNorm": "column",
                        "ZeroCenteredRMSNorm": "replicated"}


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """``fast_hadamard_transform.hadamard_transform(x, scale=n ** -0.5)`` in torch (any float
    dtype; ``n`` = ``x.shape[-1]``, a power of two): ``x @ H_n / sqrt(n)``, Sylvester's ``H_n``."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    h = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x @ h) * n ** -0.5


def _dsa_attention(submodules: Any) -> None:
    """Make one MLA layer spec a DSA one, as Megatron-Core's ``get_dsa_module_spec_for_backend``
    does with TE, on CPU: down-projections Megatron's local replicated ``Linear`` (the class
    ``MLASelfAttention`` accepts besides TE's), the indexer's linears the same class taking
    ``parallel_mode``,
    norms separate (the indexer reads the normalized query), ``DSAttention`` with a
    ``DSAIndexer`` as the core attention. The indexer's Hadamard rotation (a GPU package,
    ``fast_hadamard_transform``, on bf16 only) runs as :func:`_hadamard`."""
    import megatron.core.transformer.experimental_attention_variant.dsa as dsa
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    dsa.rotate_activation = _hadamard
    duplicated = _duplicated_linear()
    submodules.linear_q_down_proj = Linear
    submodules.linear_kv_down_proj = Linear
    submodules.core_attention = ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(
        indexer=ModuleSpec(module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
            linear_wq_b=duplicated, linear_wk=duplicated, k_norm=WrappedTorchNorm, linear_weights_proj=duplicated))))


def fake_grouped_gemm() -> None:
    """Let legacy ``GroupedMLP`` build on CPU for layout inspection: install a looped
    stand-in for the ``grouped_gemm`` package (``gmm(a, b, batch_sizes, trans_b)``)."""
    import types

    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        outs, start = [], 0
        for i, n in enumerate(batch_sizes.tolist()):
            outs.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
            start += n
        return torch.cat(outs, 0)

    gg.grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))
    gg.ops = gg.grouped_gemm.ops


def _sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """Megatron-Core's ``get_sliding_window_causal_mask`` (``[sq, skv]`` bool, True = masked), on the
    CPU (upstream allocates it with ``device="cuda"``)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _patch_moe_utils() -> None:
    """See point 3 of :func:`apply_cpu_patches`."""
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


@contextlib.contextmanager
def _no_tensor_cuda() -> Iterator[None]:
    """Make ``Tensor.cuda()`` a no-op while building a model (restored afterwards).

    With tied embeddings and PP>1, ``LanguageModule.setup_embeddings_and_output_layer``
    does ``weight.data = weight.data.cuda()`` before all-reducing the embedding
    copy between the first and last stages.
    """
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def optimizer_on_cpu() -> Iterator[None]:
    """Megatron-Core's optimizer and gradient sync on CPU (wrap building the optimizer, each
    step, and from 0.19 ``finish_grad_sync``): its ``device='cuda'`` factories make CPU tensors,
    ``Tensor.cuda()`` is a no-op, ``Tensor.type()`` names the CUDA type it checks for and
    ``torch.cuda.current_stream()`` is a stream whose waits do nothing (all restored afterwards)."""
    saved = {n: getattr(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full", "arange")}

    def on_cpu(fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return inner

    cuda, typ, stream = torch.Tensor.cuda, torch.Tensor.type, torch.cuda.current_stream
    for n, fn in saved.items():
        setattr(torch, n, on_cpu(fn))
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = lambda self, *a, **k: typ(self, *a, **k) if a or k else typ(self).replace("torch.", "torch.cuda.", 1)
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)
        torch.Tensor.cuda, torch.Tensor.type, torch.cuda.current_stream = cuda, typ, stream


class _NoStream:
    """What ``torch.cuda.current_stream()`` returns on CPU: CPU work is in order, waits are no-ops."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass



def bf16_adam_trainer(hf_config: Any, *, lr: float, distributed: bool = True, seed: int = 0) -> tuple[Any, Any, Any]:
    """The GPT of ``hf_config`` (tp=1) in bf16 under Megatron-Core DDP (gradients reduced in
    fp32) and Megatron's Adam (betas 0.9 / 0.999, no weight decay, no clipping, constant ``lr``;
    the ``DistributedOptimizer`` or, with ``distributed=False``, the non-distributed mixed-precision
    one), built on CPU in train mode: ``(model, ddp, optimizer)``. Needs :func:`init_parallel`."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_gpt_model(dataclasses.replace(gpt_arch_from_hf(hf_config, tp=1), dtype="bfloat16"), seed=seed)
    model.config.bf16 = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), model)
    with optimizer_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, bf16=True, use_distributed_optimizer=distributed,
            adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, clip_grad=0.0), [ddp])
    model.train()
    return model, ddp, opt


# --------------------------------------------------------------------------- parallel state
def init_parallel(*, rank: int, world_size: int, master_port: int, tp: int, pp: int, ep: int = 1,
                  etp: int | None = None, vpp: int = 1) -> None:
    """Initialise (or re-initialise) gloo + Megatron model parallelism for this rank.

    The default gloo process group is created once per process (on
    ``127.0.0.1:master_port``); later calls may change ``tp``/``pp`` (any data
    parallelism fills the rest of ``world_size``). Models built under a previous
    layout must not be used afterwards.
    """
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{master_port}",
            rank=rank,
            world_size=world_size,
        )
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(
            f"process group already initialised as rank {dist.get_rank()}/"
            f"{dist.get_world_size()}, asked for {rank}/{world_size}"
        )
    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} not divisible by tp*pp={tp * pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    _patch_moe_utils()
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_sliding_window_causal_mask = _sliding_window_mask
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


# --------------------------------------------------------------------------- model
def _base_config_kwargs(arch: GPTArch, ps: Any) -> dict[str, Any]:
    """``TransformerConfig`` kwargs of a dense CPU model: fp32, RMSNorm, SwiGLU, no dropout, no fusions."""
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.ffn_hidden_size,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=getattr(torch, arch.dtype),
        params_dtype=getattr(torch, arch.dtype),
        bf16=arch.dtype == "bfloat16",
        use_cpu_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # fused kernels are CUDA-only
        **dict.fromkeys(("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                         "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion"),
                        False),
    )


def _gpt_oss_config_kwargs(arch: GPTArch) -> dict[str, Any]:
    """gpt-oss's departures from :func:`_base_config_kwargs` (see :class:`GPTArch`), where ``arch`` has them."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    kwargs: dict[str, Any] = dict(add_bias_linear=arch.add_bias_linear, glu_linear_offset=arch.glu_linear_offset,
                                  activation_func_clamp_value=arch.activation_clamp)
    if arch.activation == "quick_gelu":
        kwargs["activation_func"] = quick_gelu
    if arch.softmax_sinks:
        kwargs["softmax_type"] = "learnable"
    if arch.sliding_window:  # Megatron keeps keys i - left .. i: left = window - 1
        kwargs.update(window_size=(arch.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(s) for s in arch.sliding_layers])
    return kwargs


def _yarn_attributes(config: Any, arch: GPTArch) -> None:
    """YaRN settings GPTModel reads from the config (``TransformerConfig`` has no fields for them;
    ``correction_range_round_to_int=False`` is HF's ``truncate=False``)."""
    factor, original, fast, slow = arch.yarn  # type: ignore[misc]
    for key, value in (("rotary_scaling_factor", factor), ("original_max_position_embeddings", original),
                       ("beta_fast", fast), ("beta_slow", slow), ("mscale", 1.0), ("mscale_all_dim", 0.0),
                       ("correction_range_round_to_int", False)):
        setattr(config, f"yarn_{key}", value)


def _moe_config_kwargs(arch: GPTArch, ps: Any) -> dict[str, Any]:
    """The MoE options of ``arch`` (``arch.num_experts`` set): router, experts, expert parallelism."""
    kwargs: dict[str, Any] = dict(
        num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk, moe_router_pre_softmax=arch.moe_router_pre_softmax,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=arch.moe_grouped_gemm,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        moe_layer_freq=[0 if i in arch.dense_layers else 1 for i in range(arch.num_layers)],
        moe_router_score_function=arch.router_score_function,
        moe_router_enable_expert_bias=arch.router_expert_bias,
        moe_router_topk_scaling_factor=arch.router_topk_scaling_factor,
    )
    if arch.router_expert_bias:
        kwargs["moe_router_dtype"] = "fp32"
    if arch.shared_expert_ffn:
        kwargs["moe_shared_expert_intermediate_size"] = arch.shared_expert_ffn
    return kwargs


def _mla_config_kwargs(arch: GPTArch) -> dict[str, Any]:
    """The multi-latent-attention options of ``arch`` (``arch.kv_lora_rank`` set), with the DSA
    indexer's where ``arch.dsa_indexer_heads`` is set."""
    kwargs: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim, qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim, v_head_dim=arch.v_head_dim,
        num_query_groups=None, kv_channels=None, rope_type="rope", rotary_base=arch.rotary_base)
    if arch.dsa_indexer_heads:
        kwargs.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=arch.dsa_indexer_heads,
                      dsa_indexer_head_dim=arch.dsa_indexer_head_dim, dsa_indexer_topk=arch.dsa_indexer_topk,
                      dsa_indexer_loss_coeff=0.0)
        if arch.dsa_indexer_topk_freq > 1:  # a release without it refuses the keyword, naming it
            kwargs.update(dsa_indexer_topk_freq=arch.dsa_indexer_topk_freq,
                          dsa_indexer_skip_topk_offset=arch.dsa_indexer_skip_topk_offset)
        kwargs.update(harness_flags())
    return kwargs


def _transformer_config(arch: GPTArch, vp_stage: int | None) -> tuple[Any, Any]:
    """(``TransformerConfig`` or ``MLATransformerConfig``, MLA core-attention class or ``None``) of ``arch``
    under the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = _base_config_kwargs(arch, ps)
    kwargs.update(_gpt_oss_config_kwargs(arch))
    if arch.num_experts:
        kwargs.update(_moe_config_kwargs(arch, ps))
    config_cls = TransformerConfig
    mla_attention = None
    if arch.kv_lora_rank:
        from megatron.core.transformer.transformer_config import MLATransformerConfig


        mla_attention = _patch_mla()
        config_cls = MLATransformerConfig
        kwargs.update(_mla_config_kwargs(arch))
    if arch.gdn_linear:
        patch_gdn_cpu()
        kwargs.update(gdn_config_kwargs(arch.gdn_linear, dict(arch.gdn_dims)))
        kwargs["moe_shared_expert_gate"] = bool(arch.shared_expert_ffn)
    if arch.mtp_layers:
        kwargs["mtp_num_layers"] = arch.mtp_layers
    kwargs.update(num_layers_in_first_pipeline_stage=arch.first_stage_layers,
                  num_layers_in_last_pipeline_stage=arch.last_stage_layers)
    if vp_stage is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = ps.get_virtual_pipeline_model_parallel_world_size()
    config = config_cls(**kwargs)
    if arch.yarn is not None:
        _yarn_attributes(config, arch)
    return config, mla_attention


def _layer_specs(arch: GPTArch, config: Any, mla_attention: Any, qk_norms: tuple[type, type] | None = None,
                 ) -> tuple[Any, Any]:
    """(decoder layer spec, MTP block spec or ``None``): the local (non-TE) spec, or the decoder
    block spec for MoE / MLA models (with ``mla_attention`` as every layer's core attention); with
    ``arch.full_qk_norm`` every layer's q / k norms are ``qk_norms`` (default :func:`full_dim_norms`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if arch.gdn_linear:
        return _gdn_block_spec(arch, config), None
    if arch.num_experts or mla_attention is not None:
        # the decoder block spec honours moe_layer_freq (dense and MoE layers in one model)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        variant = getattr(config, "experimental_attention_variant", None)
        config.experimental_attention_variant = None  # 0.19 asserts none; DSA is put in below, as upstream's TE spec
        try:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        finally:
            config.experimental_attention_variant = variant
        if mla_attention is not None:
            for layer_spec in spec.layer_specs:
                layer_spec.submodules.self_attention.submodules.core_attention = mla_attention
                if arch.dsa_indexer_heads:
                    _dsa_attention(layer_spec.submodules.self_attention.submodules)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
    if arch.full_qk_norm:
        q_norm, k_norm = qk_norms or full_dim_norms()
        for layer_spec in getattr(spec, "layer_specs", [spec]):
            layer_spec.submodules.self_attention.submodules.q_layernorm = q_norm
            layer_spec.submodules.self_attention.submodules.k_layernorm = k_norm
    mtp_spec = None
    if arch.mtp_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return spec, mtp_spec


def _gdn_block_spec(arch: GPTArch, config: Any) -> Any:
    """This pipeline stage's decoder block of a gated-DeltaNet hybrid (:mod:`megarefit.demo.megatron_gdn`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    base = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, qk_layernorm=True, normalization="RMSNorm")
    first = get_transformer_layer_offset(config)
    layers = gdn_layer_specs(base, arch.gdn_linear)
    return TransformerBlockSubmodules(layer_specs=layers[first:first + get_num_layers_to_build(config)],
                                      layer_norm=ZeroCenteredRMSNorm)


def build_gpt_model(arch: GPTArch, *, seed: int = 1234, vp_stage: int | None = None,
                    qk_norms: tuple[type, type] | None = None) -> GPTModel:
    """Build this rank's shard of a Megatron ``GPTModel`` on CPU (``arch.dtype``, eval mode).

    Uses the current parallel state (see :func:`init_parallel`);
    ``pre_process``/``post_process`` follow the pipeline stage. SwiGLU MLP,
    RMSNorm, RoPE, no linear biases except optional QKV bias. The default torch
    RNG is seeded from ``seed`` and the pipeline rank (same on every TP rank), so
    the result is deterministic. ``vp_stage``: with a virtual pipeline
    (``init_parallel(vpp=...)``), build that model chunk of this rank. ``qk_norms``: the q / k norm
    classes of a model whose norms run over all heads (``arch.full_qk_norm``; default the harness's,
    :func:`full_dim_norms`; Megatron-Bridge's ``FullDimQNorm`` / ``FullDimKNorm`` fit too).
    """
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config, mla_attention = _transformer_config(arch, vp_stage)
    spec, mtp_spec = _layer_specs(arch, config, mla_attention, qk_norms)
    # Seed per pipeline stage: the same seed on every stage would give local layer i
    # identical values on every stage (hiding layer-renumbering bugs).
    torch.manual_seed(seed + 7919 * ps.get_pipeline_model_parallel_rank())
    with _no_tensor_cuda():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=arch.padded_vocab_size,
            max_sequence_length=arch.max_sequence_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            vp_stage=vp_stage,
            parallel_output=False,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="yarn" if arch.yarn is not None else "rope",
            rotary_base=arch.rotary_base,
            rotary_percent=arch.rotary_percent,
            mtp_block_spec=mtp_spec,
        )
    if arch.dtype != "float32":  # the local spec's norms ignore params_dtype (Megatron's Float16Module casts them)
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(getattr(torch, arch.dtype))
    return model.eval()


@torch.no_grad()
def forward_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """Run a full forward pass across all pipeline stages.

    ``tokens``: ``[batch, seq]`` int64, identical on every rank. Stages are run
    in order; activations ``[seq, batch, hidden]`` go to the next stage by gloo
    send/recv and enter via ``model.set_input_tensor``. Returns fp32 logits
    ``[batch, seq, padded_vocab]`` on every TP rank of the last pipeline stage,
    ``None`` on other stages.
    """
    from megatron.core import parallel_state as ps

    batch, seq = tokens.shape
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(tokens, position_ids, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out.float()


def gpt_arch_from_hf(hf_config: Any, *, tp: int = 1, make_vocab_size_divisible_by: int = 128,
                     max_sequence_length: int = 256, mtp_layers: int = 0) -> GPTArch:
    """GPTArch for an HF config (Llama / Mistral / Qwen2 / Qwen3, Qwen3-MoE / Mixtral,
    DeepSeek-V3-style MLA, GLM-4.5 / GLM-5, gpt-oss, MiniMax-M2, Qwen3.5 / Qwen3-Next), vocab padded
    as Megatron pads it.

    Raises:
        MegarefitError: the config needs something this harness does not build
            (linear biases beyond QKV, RoPE scaling).
    """
    from megarefit.errors import MegarefitError
    from megarefit.layout.dims import ModelDims, load_hf_config

    cfg = load_hf_config(hf_config)
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    dims = ModelDims.from_hf_config(cfg)
    gpt_oss = _gpt_oss_arch(get) if dims.family == "gpt_oss" else {}
    if (dims.proj_bias or dims.mlp_bias) and not gpt_oss:
        raise MegarefitError("the CPU harness builds no linear biases besides QKV (add_bias_linear=False)")
    if dims.kv_lora_rank and not dims.q_lora_rank and megatron_series() >= (0, 19):
        raise MegarefitError(
            "megatron-core 0.19 builds MLA without q_lora_rank (and with kv_layernorm) only with a Q norm fused "
            "into linear_q_proj (Transformer Engine; its QKNormConfigResolver), which HF's q_proj does not have: "
            "the CPU harness cannot build this config on 0.19 (0.16-0.18 can)")
    if (get("n_group") or 1) > 1:
        raise MegarefitError("group-limited routing differs between Megatron and HF unless topk/group_topk == 2; "
                             "use n_group=1 for the CPU harness")
    rope = get("rope_parameters") or {}
    scaling = get("rope_scaling") or {}
    if "yarn" not in gpt_oss and (scaling.get("rope_type", scaling.get("type", "default")) != "default" or (
            rope.get("rope_type", "default") != "default")):
        raise MegarefitError("the CPU harness builds plain RoPE only; drop rope_scaling from the config")
    theta = get("rope_theta") or rope.get("rope_theta") or 10000.0
    gdn = _gdn_arch(dims)
    return GPTArch(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_query_groups, kv_channels=dims.head_dim, ffn_hidden_size=dims.ffn_hidden_size,
        padded_vocab_size=dims.padded_vocab_size(tp, make_vocab_size_divisible_by), qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm or bool(dims.kv_lora_rank), tie_word_embeddings=dims.tie_word_embeddings,
        full_qk_norm=dims.qk_norm and dims.full_qk_norm,
        rotary_base=float(theta), norm_epsilon=float(get("rms_norm_eps") or 1e-5),
        rotary_percent=float(get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                             or (get("rotary_dim") or dims.head_dim) / dims.head_dim),  # MiniMax-M2: rotary_dim
        max_sequence_length=max_sequence_length,
        num_experts=dims.num_experts, moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_router_topk=int(get("num_experts_per_tok") or 2),
        # HF renormalises the top-k probabilities unless norm_topk_prob is False (Mixtral always does)
        moe_router_pre_softmax=get("norm_topk_prob", True) is False,
        dense_layers=dims.dense_layers,
        shared_expert_ffn=dims.shared_expert_ffn,
        # HF Glm4Moe has no scoring_func key: its noaux_tc router (with e_score_correction_bias) is sigmoid
        router_score_function=get("scoring_func") or ("sigmoid" if dims.router_bias else "softmax"),
        router_expert_bias=dims.router_bias,
        router_topk_scaling_factor=float(get("routed_scaling_factor")) if get("routed_scaling_factor") else None,
        q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank, qk_head_dim=dims.qk_nope_head_dim,
        qk_pos_emb_head_dim=dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim, mtp_layers=mtp_layers,
        dsa_indexer_heads=dims.index_n_heads, dsa_indexer_head_dim=dims.index_head_dim,
        dsa_indexer_topk=int(get("index_topk") or 0), **_indexer_sharing(dims, get),
        **gpt_oss, **gdn,
    )


def _gdn_arch(dims: ModelDims) -> dict[str, Any]:
    """A gated-DeltaNet hybrid's GPTArch fields (``{}`` for other models; ``GatedDeltaNet`` ships in
    every verified release, 0.16.1 included)."""
    if not dims.linear_layers:
        return {}
    return {"gdn_linear": tuple(i in dims.linear_layers for i in range(dims.num_layers)), "gdn_dims": (
        ("linear_num_key_heads", dims.gdn_key_heads), ("linear_num_value_heads", dims.gdn_value_heads),
        ("linear_key_head_dim", dims.gdn_key_dim), ("linear_value_head_dim", dims.gdn_value_dim),
        ("linear_conv_kernel_dim", dims.conv_kernel))}


def _indexer_sharing(dims: ModelDims, get: Any) -> dict[str, int]:
    """Megatron-Core 0.19's DSA top-k sharing for HF ``indexer_types``: the HF schedule (0-indexed
    ``i`` full iff ``max(i - offset + 1, 0) % freq == 0``) is Megatron's (1-indexed ``L`` full iff
    ``max(L - max(offset, 1), 0) % freq == 0``) for ``offset >= 1``.

    Raises:
        UnsupportedModelError: shared layers the freq / offset schedule cannot express."""
    if not dims.shared_indexer_layers:
        return {}
    from megarefit.layout.hf_dims import index_share_keys

    freq, offset = index_share_keys(get)
    megatron = tuple(i for i in range(dims.num_layers) if max(i + 1 - max(offset, 1), 0) % freq)
    if megatron_series() < (0, 19):
        import megatron.core

        raise UnsupportedModelError(f"shared DSA indexers (layers {list(dims.shared_indexer_layers)[:8]}): "
                                    f"megatron-core {megatron.core.__version__} cannot build them "
                                    "(dsa_indexer_topk_freq is 0.19+); run with megatron-core 0.19 or later")
    if freq <= 1 or megatron != dims.shared_indexer_layers:
        raise UnsupportedModelError(f"shared DSA indexers at layers {list(dims.shared_indexer_layers)[:8]}: "
                                    "Megatron-Core builds them from dsa_indexer_topk_freq / "
                                    f"dsa_indexer_skip_topk_offset only (index_topk_freq={freq}, "
                                    f"index_skip_topk_offset={offset} give {list(megatron)[:8]})")
    return {"dsa_indexer_topk_freq": freq, "dsa_indexer_skip_topk_offset": offset}


def _gpt_oss_arch(get: Any) -> dict[str, Any]:
    """The :class:`GPTArch` fields of a gpt-oss config (``get``: its key lookup).

    Raises:
        MegarefitError: RoPE scaling other than YaRN with ``truncate=False``, or another
            GLU slope than quick-GELU's 1.702.
    """
    from megarefit.errors import MegarefitError

    scaling = get("rope_scaling") or get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    yarn = None
    if kind == "yarn":
        if scaling.get("truncate", True) is not False:
            raise MegarefitError("the CPU harness builds YaRN with truncate=False (gpt-oss's) only")
        yarn = (float(scaling["factor"]), int(scaling["original_max_position_embeddings"]),
                float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0)))
    elif kind != "default":
        raise MegarefitError(f"the CPU harness builds gpt-oss with YaRN or plain RoPE, not {kind!r}")
    if float(get("swiglu_alpha", 1.702) or 1.702) != 1.702:
        raise MegarefitError("Megatron's quick_gelu has slope 1.702; the config's swiglu_alpha differs")
    types = get("layer_types") or []
    window = int(get("sliding_window") or 0) if "sliding_attention" in types else 0
    out = dict(add_bias_linear=True, softmax_sinks=True, activation="quick_gelu", glu_linear_offset=1.0,
               activation_clamp=float(get("swiglu_limit") or 7.0), sliding_window=window,
               sliding_layers=tuple(t == "sliding_attention" for t in types), yarn=yarn)
    return {k: v for k, v in out.items() if v is not None}


@torch.no_grad()
def perturb_parameters_(model: torch.nn.Module, *, seed: int, scale: float = 0.05) -> None:
    """Add deterministic noise to every parameter, in place.

    Megatron initialises norms to 1 and biases to 0, which would hide a swapped
    norm or bias in a layout test. Noise is keyed by (name, pipeline rank, and
    TP rank for TP-sharded tensors), so replicated tensors stay identical across
    TP ranks. A tied output-layer copy gets the embedding's noise, so the two
    copies stay equal.
    """
    import zlib

    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank, etp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, p in refit_tensors(model).items():
        key, stage = name, pp_rank
        if tied and name == "output_layer.weight":
            key, stage = "embedding.word_embeddings.weight", 0
        if ".mlp.experts." in name:  # routed experts: identity = (ep rank, local expert, expert-TP rank)
            shard = f"ep{ep_rank}/etp{etp_rank if etp > 1 else -1}"
        else:  # replicated over ep; TP-sharded tensors differ per TP rank
            split = getattr(p, "tensor_model_parallel", False) or name.endswith(".softmax_offset")  # sinks: by head
            shard = f"tp{tp_rank if split else -1}"
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}/{stage}/{shard}".encode()))
        p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
