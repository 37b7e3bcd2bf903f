"""Harness that builds REAL Megatron-Core ``MambaModel`` instances (hybrid Mamba-2 / attention /
MLP / MoE, NVIDIA Nemotron-H and Nemotron-3-Nano style) on CPU.

The companion of :mod:`megarefit.demo.megatron_cpu` (``GPTModel``), with which it shares the
process setup (:func:`~megarefit.demo.megatron_cpu.init_parallel`: gloo, one process per
rank) and the generic CPU patches.

CPU recipe (verified with megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2, no ``mamba_ssm``,
``causal_conv1d`` or Transformer Engine installed):

* everything :mod:`megarefit.demo.megatron_cpu` does (gloo, ``use_cpu_initialization``, fusions
  off, inference RNG tracker, ``torch.cuda.current_device() -> "cpu"``);
* the Mamba-specific patches of :func:`apply_mamba_cpu_patches` (one audited function): let
  ``MambaMixer`` build without ``mamba_ssm``, give it a torch gated RMSNorm and a torch SSD
  scan, and a torch final norm for the stack (0.16-0.17: ``MambaStack`` in
  ``megatron.core.ssm.mamba_block``; from 0.18: ``HybridStack`` in
  ``megatron.core.models.hybrid.hybrid_block``, of which ``MambaStack`` is an alias and
  ``ssm.mamba_block`` a re-export);
* a local (non-TE) layer spec (:func:`mamba_stack_spec`), because Megatron-Core ships none; the
  Mamba pre-norm gets ``eps`` from the spec up to 0.18, from ``MambaLayer`` itself
  (``config.layernorm_epsilon``) from 0.19;
* ``use_mamba_mem_eff_path=False``: the mixer runs its prefill path (``in_proj`` -> depthwise
  causal conv + SiLU in torch, since ``causal_conv1d_fn`` is ``None`` (up to 0.18 its
  ``nn.Conv1d``, from 0.19 ``F.conv1d`` on its ``conv1d_weight`` / ``conv1d_bias``) -> SSD scan
  -> gated norm -> ``out_proj``);
* ``MambaModel`` on every version (from 0.18 a deprecated subclass of ``HybridModel`` that
  still takes ``mamba_stack_spec`` and ``hybrid_override_pattern``);
* eval mode (Megatron refuses MoE with TP>1 in training mode without sequence parallelism);
* ``position_embedding_type="none"`` (Nemotron-H attention has no RoPE) and
  ``parallel_output=False``, so the last stage returns full-vocabulary logits on every TP rank.

Layer symbols of ``MambaArch.pattern`` (Megatron's ``hybrid_override_pattern``): ``M`` Mamba-2
mixer, ``*`` self-attention, ``-`` dense MLP, ``E`` MoE. Parameter names in this local spec
(``i`` = global layer index, pp=1):

* ``M``: ``decoder.layers.i.norm.weight`` (pre-norm; in Megatron's TE spec it is fused as
  ``mixer.in_proj.layer_norm_weight``), ``mixer.in_proj.weight``, ``mixer.conv1d.weight`` and
  ``mixer.conv1d.bias`` (from 0.19 ``mixer.conv1d_weight`` and ``mixer.conv1d_bias``, same
  shapes), ``mixer.dt_bias``, ``mixer.A_log``, ``mixer.D``, ``mixer.norm.weight``,
  ``mixer.out_proj.weight``;
* ``*``: ``input_layernorm.weight`` (TE: ``self_attention.linear_qkv.layer_norm_weight``),
  ``self_attention.linear_qkv.weight``, ``self_attention.linear_proj.weight``;
* ``-``: ``pre_mlp_layernorm.weight`` (TE: ``mlp.linear_fc1.layer_norm_weight``),
  ``mlp.linear_fc1.weight``, ``mlp.linear_fc2.weight``;
* ``E``: ``pre_mlp_layernorm.weight``, ``mlp.router.weight`` (+ the fp32 BUFFER
  ``mlp.router.expert_bias``), ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``,
  ``mlp.shared_experts.linear_fc{1,2}.weight``;
* ``embedding.word_embeddings.weight``, ``decoder.final_norm.weight``, ``output_layer.weight``.

Per-rank layout at tensor parallelism ``tp`` (rank ``r``; ``I = heads * head_dim``,
``G`` groups, ``N`` state size; every component is cut into ``tp`` contiguous chunks):

* ``in_proj.weight`` ``[(2I + 2GN + heads)/tp, H]`` is ``[z_r; x_r; B_r; C_r; dt_r]``, NOT a
  contiguous row block of HF's ``[z; x; B; C; dt]`` (Megatron-Bridge's ``MambaInProjMapping``);
* ``conv1d.weight`` ``[(I + 2GN)/tp, 1, K]`` and ``conv1d.bias`` (0.19: ``conv1d_weight`` /
  ``conv1d_bias``) are ``[x_r; B_r; C_r]``
  (``MambaConv1dMapping``);
* ``A_log``, ``D``, ``dt_bias`` ``[heads/tp]`` and ``norm.weight`` ``[I/tp]`` are plain dim-0
  chunks (the gated norm is per group of ``I/G`` channels, so no collective is needed);
* ``out_proj.weight`` ``[H, I/tp]`` is row-parallel (a dim-1 chunk);
* ``linear_qkv`` is interleaved per query group (``[q_g; k_g; v_g]``), then chunked;
  expert weights are split over ``ep`` (experts ``r_ep * E/ep ...``) and ``etp``.

Megatron requires ``heads % tp == 0``, ``G % tp == 0`` and ``heads % G == 0``. The mixer's
``conv1d``, ``dt_bias`` and ``A_log`` are drawn on each rank at their local size (not sliced
from one master tensor, unlike the linear layers), so the model a seed gives depends on ``tp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megarefit.demo.megatron_cpu import apply_cpu_patches, forward_logits, megatron_series

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.models.mamba import MambaModel

__all__ = ["MambaArch", "apply_mamba_cpu_patches", "build_mamba_model", "mamba_arch_from_hf",
           "mamba_forward_logits", "mamba_stack_spec", "torch_mamba_chunk_scan"]

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# HF layers_block_type names (transformers 5 names and the legacy ones) -> Megatron symbols
_HF_BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                     "mlp": "-", "moe": "E"}
# Megatron's MambaMixer hard-codes the eps of its gated RMSNorm (mamba_mixer.py, ``eps=1e-5``)
MIXER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class MambaArch:
    """Architecture of a hybrid Mamba-2 model (Nemotron-H style) as plain numbers.

    ``pattern`` has one symbol per layer (see :data:`LAYER_SYMBOLS`). Experts and the shared
    expert are non-gated squared-ReLU MLPs; the router is a sigmoid with an fp32 expert
    (score-correction) bias, top-k weights renormalised (``norm_topk_prob``, which Megatron
    does exactly when ``moe_router_topk > 1``) and scaled by ``router_topk_scaling_factor``.
    """

    num_layers: int
    hidden_size: int
    pattern: str
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_num_groups: int
    mamba_state_dim: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # attention head_dim
    ffn_hidden_size: int  # the '-' layers
    padded_vocab_size: int  # already padded by the caller (divisible by tp)
    conv_kernel: int = 4
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 2
    shared_expert_ffn: int = 0  # 0: no shared expert
    router_topk_scaling_factor: float | None = None
    norm_topk_prob: bool = True
    norm_epsilon: float = 1e-5  # every norm except the mixer's gated norm (MIXER_NORM_EPS)
    max_sequence_length: int = 256
    dtype: str = "float32"  # or "bfloat16" (every parameter cast, as Megatron's Float16Module does)

    def __post_init__(self) -> None:
        from megarefit.errors import MegarefitError

        bad = sorted(set(self.pattern) - set(LAYER_SYMBOLS))
        if bad or len(self.pattern) != self.num_layers:
            raise MegarefitError(f"pattern {self.pattern!r} must have {self.num_layers} symbols out of "
                                 f"{''.join(LAYER_SYMBOLS)} (unknown: {bad})")
        if "E" in self.pattern and not (self.num_experts and self.moe_ffn_hidden_size):
            raise MegarefitError("an 'E' layer needs num_experts and moe_ffn_hidden_size")
        if "E" in self.pattern and self.norm_topk_prob != (self.moe_router_topk > 1):
            raise MegarefitError(
                "Megatron's sigmoid router renormalises the top-k weights exactly when top-k > 1; "
                f"norm_topk_prob={self.norm_topk_prob} with top-k {self.moe_router_topk} cannot be built")
        if self.dtype not in ("float32", "bfloat16"):
            raise MegarefitError(f"dtype {self.dtype!r}: float32 or bfloat16")


# --------------------------------------------------------------------------- torch kernels
class TorchRMSNormGated(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` in torch (its ``rms_norm_ref``), for
    ``norm_before_gate=False`` as Megatron builds it.

    ``forward(x, z)``: ``x, z`` ``[..., d]``; returns ``rms_g(x * silu(z)) * weight`` in ``x``'s
    dtype, where ``rms_g`` normalises each group of ``group_size`` channels (math in fp32).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if norm_before_gate:
            raise NotImplementedError("TorchRMSNormGated implements norm_before_gate=False only")
        self.eps = eps
        self.group_size = group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if z is not None:
            x = x * F.silu(z.float())
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)
        return (groups.reshape(x.shape) * self.weight.float()).to(dtype)


class ExtendedRMSNorm(TorchRMSNormGated):
    """Megatron's ``mamba_mixer.ExtendedRMSNorm`` (``RMSNormGated`` with a sharded state dict)
    on :class:`TorchRMSNormGated`; ``sharded_state_dict`` copied from megatron-core 0.16.1."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        """Sharding along axis 0, bias not sharded (as upstream)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def torch_mamba_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           chunk_size: int, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                           seq_idx: Any = None, cu_seqlens: Any = None, dt_softplus: bool = False,
                           dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False,
                           return_varlen_states: bool = False) -> Any:
    """``mamba_ssm``'s ``mamba_chunk_scan_combined`` (Mamba-2 SSD) as the plain recurrence, in fp32.

    Shapes: ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]``, ``B``/``C`` ``[b, l, g, n]``
    (head ``i`` reads group ``i // (h/g)``), ``D`` ``[h]`` or ``[h, p]``, ``z`` like ``x``,
    ``dt_bias`` ``[h]``, ``initial_states`` ``[b, h, p, n]``. With ``dt' = softplus(dt + dt_bias)``::

        S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T        y_t = S_t C_t + D x_t   (* silu(z_t))

    Returns ``y`` ``[b, l, h, p]`` in ``x``'s dtype, and the final state ``[b, h, p, n]`` if
    ``return_final_states``. ``chunk_size`` only tiles the GPU kernel: the result does not depend
    on it. Packed sequences (``seq_idx``, ``cu_seqlens``) are not supported.
    """
    del chunk_size
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("torch_mamba_chunk_scan: packed / variable-length sequences")
    heads, groups = x.shape[2], B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(*dt_limit)
    decay = torch.exp(dt * A.float())  # [b, l, h]
    Bh = B.float().repeat_interleave(heads // groups, dim=2)  # [b, l, h, n]
    Ch = C.float().repeat_interleave(heads // groups, dim=2)
    xf = x.float()
    state = (initial_states.float() if initial_states is not None
             else xf.new_zeros(x.shape[0], heads, x.shape[3], B.shape[3]))
    ys = []
    for t in range(x.shape[1]):
        inflow = (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]  # [b, h, p, n]
        state = decay[:, t, :, None, None] * state + inflow
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


# --------------------------------------------------------------------------- CPU patches
_MAMBA_PATCHED = False


def apply_mamba_cpu_patches() -> None:
    """Apply every process-wide workaround needed to build and run ``MambaModel`` on CPU.

    Idempotent. Patches (all module attributes, in one place; the same on 0.16.1, 0.17.1, 0.18.2
    and 0.19.2 except where a version is named):

    0. :func:`megarefit.demo.megatron_cpu.apply_cpu_patches` (``torch.cuda.current_device()``
       -> ``"cpu"``: the mixer allocates ``conv1d``, ``dt_bias``, ``A_log``, ``D`` and its norm
       with ``device=torch.cuda.current_device()``; warning filters).
    1. ``megatron.core.ssm.mamba_mixer.HAVE_MAMBA_SSM = True``: without ``mamba_ssm`` the flag is
       False and ``MambaMixer.__init__`` raises ``ImportError``; the flag guards nothing else,
       and the GPU kernels it stands for are replaced by 2 and 3.
    2. ``mamba_mixer.ExtendedRMSNorm`` -> :class:`ExtendedRMSNorm` (torch, same name and
       ``sharded_state_dict``): without ``mamba_ssm``, ``RMSNormGated`` is a ``MagicMock`` instance,
       so the ``class ExtendedRMSNorm(RMSNormGated)`` statement makes yet another ``MagicMock``, and
       the mixer's ``norm.weight`` silently vanishes from the parameters.
    3. ``mamba_mixer.mamba_chunk_scan_combined`` -> :func:`torch_mamba_chunk_scan` (the Triton
       SSD kernel is missing without ``mamba_ssm``: 0.16 leaves the module global undefined, so the
       patch defines it; from 0.17 it is ``None``, so the patch replaces it). Only the prefill path
       (``use_mamba_mem_eff_path=False``) is usable: ``mamba_split_conv1d_scan_combined`` (the
       fused training path) and ``selective_state_update`` (decode) stay unavailable.
       ``causal_conv1d_fn`` is ``None`` already, so the mixer's conv is torch: its ``nn.Conv1d``
       + SiLU up to 0.18, ``F.conv1d`` on ``conv1d_weight`` / ``conv1d_bias`` + SiLU from 0.19
       (``MambaContextParallel.conv1d``); no patch needed for it.
    4. ``TENorm`` -> ``WrappedTorchNorm`` in the module of the stack class (:func:`_stack_module`:
       ``megatron.core.ssm.mamba_block`` up to 0.17, ``megatron.core.models.hybrid.hybrid_block``
       from 0.18, where ``ssm.mamba_block`` only re-exports it and patching it would miss): the
       stack builds its ``final_norm`` with ``TENorm`` whatever the spec, which raises without
       Transformer Engine.
    """
    global _MAMBA_PATCHED
    apply_cpu_patches()
    if _MAMBA_PATCHED:
        return
    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _patch(mamba_mixer, "HAVE_MAMBA_SSM", True)
    _patch(mamba_mixer, "ExtendedRMSNorm", ExtendedRMSNorm)
    _patch(mamba_mixer, "mamba_chunk_scan_combined", torch_mamba_chunk_scan, defined=megatron_series() >= (0, 17))
    _patch(_stack_module(), "TENorm", WrappedTorchNorm)
    _MAMBA_PATCHED = True


def _patch(module: Any, name: str, value: Any, *, defined: bool = True) -> None:
    """``module.name = value``. ``defined``: this megatron-core defines ``module.name`` (without
    ``mamba_ssm`` and Transformer Engine); then raise if it is missing, as nothing would be replaced."""
    if defined and not hasattr(module, name):
        import megatron.core

        raise ImportError(f"megatron-core {megatron.core.__version__}: {module.__name__} has no {name} "
                          "to patch; this CPU harness does not know this version")
    setattr(module, name, value)


def _stack_module() -> Any:
    """The module that defines the hybrid stack and its submodules dataclass: up to 0.17
    ``megatron.core.ssm.mamba_block`` (``MambaStack``, ``MambaStackSubmodules``), from 0.18
    ``megatron.core.models.hybrid.hybrid_block`` (``HybridStack``, ``HybridStackSubmodules``)."""
    if megatron_series() >= (0, 18):
        from megatron.core.models.hybrid import hybrid_block

        return hybrid_block
    from megatron.core.ssm import mamba_block

    return mamba_block


# --------------------------------------------------------------------------- HF config
def mamba_arch_from_hf(hf_config: Any, *, tp: int = 1, make_vocab_size_divisible_by: int = 128,
                       max_sequence_length: int = 256) -> MambaArch:
    """MambaArch for an HF NemotronH config (``config.json`` dict, path, or ``NemotronHConfig``),
    vocab padded as Megatron pads it (to a multiple of ``make_vocab_size_divisible_by * tp``).

    Not a refusal but a known forward difference: transformers clamps ``softplus(dt + dt_bias)``
    to at least ``time_step_min`` (Nano: 1e-3); Megatron (and vLLM) do not clamp. The shared
    expert is ``moe_shared_expert_intermediate_size * n_shared_experts`` wide (only 1 accepted).

    Raises:
        MegarefitError: the config needs something Megatron-Core (or this harness) does not build
            exactly; the message says what.
    """
    from megarefit.layout.dims import load_hf_config

    cfg = load_hf_config(hf_config)
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    pattern = _hf_pattern(get)
    _refuse_unbuildable(get, pattern, tp)
    heads = int(get("num_attention_heads"))
    experts = int(get("n_routed_experts") or get("num_local_experts") or 0) if "E" in pattern else 0
    multiple = make_vocab_size_divisible_by * tp
    scaling = get("routed_scaling_factor")
    return MambaArch(
        num_layers=len(pattern), hidden_size=int(get("hidden_size")), pattern=pattern,
        mamba_num_heads=int(get("mamba_num_heads")), mamba_head_dim=int(get("mamba_head_dim")),
        mamba_num_groups=int(get("n_groups") or get("mamba_n_groups")),
        mamba_state_dim=int(get("ssm_state_size")), conv_kernel=int(get("conv_kernel") or get("mamba_d_conv") or 4),
        num_attention_heads=heads, num_query_groups=int(get("num_key_value_heads") or heads),
        kv_channels=int(get("head_dim") or int(get("hidden_size")) // heads),
        ffn_hidden_size=int(get("intermediate_size")),
        padded_vocab_size=-(-int(get("vocab_size")) // multiple) * multiple,
        num_experts=experts,
        moe_ffn_hidden_size=int(get("moe_intermediate_size") or 0) if experts else 0,
        moe_router_topk=int(get("num_experts_per_tok") or 2),
        shared_expert_ffn=(int(get("moe_shared_expert_intermediate_size") or 0)
                           * int(get("n_shared_experts", 1) or 0)) if experts else 0,
        router_topk_scaling_factor=float(scaling) if scaling not in (None, 1, 1.0) else None,
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        norm_epsilon=float(get("layer_norm_epsilon") or 1e-5),
        max_sequence_length=max_sequence_length,
    )


def _hf_pattern(get: Any) -> str:
    """Megatron layer symbols of an HF NemotronH config (``hybrid_override_pattern`` or
    ``layers_block_type``)."""
    from megarefit.errors import MegarefitError

    pattern = get("hybrid_override_pattern")
    if not pattern:
        types = get("layers_block_type") or get("layer_types")
        if not types:
            raise MegarefitError("the config has neither hybrid_override_pattern nor layers_block_type")
        unknown = sorted({t for t in types if t not in _HF_BLOCK_SYMBOLS})
        if unknown:
            raise MegarefitError(f"layer types {unknown} have no Megatron MambaStack layer")
        pattern = "".join(_HF_BLOCK_SYMBOLS[t] for t in types)
    bad = sorted(set(pattern) - set(LAYER_SYMBOLS))
    if bad:
        raise MegarefitError(f"pattern symbols {bad} ({pattern!r}) have no layer here (only M * - E)")
    return pattern


def _refuse_unbuildable(get: Any, pattern: str, tp: int) -> None:
    """Raise MegarefitError for what the Megatron model built here would not compute like HF."""
    from megarefit.errors import MegarefitError

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise MegarefitError(f"cannot build this NemotronH config with Megatron-Core on CPU: {why}")

    need(get("mamba_hidden_act", "silu") == "silu", "Megatron's MambaMixer activation is SiLU")
    need(get("mlp_hidden_act", "relu2") == "relu2", "the MLP / expert activation must be relu2 (squared ReLU)")
    for key in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
        need(not get(key), f"{key}=True: Megatron's MambaMixer asserts bias=False; no linear biases are built")
    need(get("use_conv_bias", True) is not False, "MambaLayer builds its mixer with conv_bias=True")
    eps = float(get("layer_norm_epsilon") or 1e-5)
    need(eps == MIXER_NORM_EPS, f"layer_norm_epsilon={eps}: Megatron's mixer norm eps is fixed to {MIXER_NORM_EPS}")
    need(not get("num_nextn_predict_layers"), "multi-token prediction layers (MambaModel has no MTP block)")
    need(not get("tie_word_embeddings"), "tied embeddings (not built by this harness)")
    need(get("sliding_window") is None, "sliding-window attention")
    heads, groups = int(get("mamba_num_heads")), int(get("n_groups") or get("mamba_n_groups"))
    need(heads % groups == 0, f"mamba_num_heads={heads} is not a multiple of n_groups={groups}")
    need(heads % tp == 0 and groups % tp == 0,
         f"Megatron splits Mamba heads ({heads}) and groups ({groups}) over tp={tp}: both must divide")
    need(int(get("num_attention_heads")) % tp == 0, f"num_attention_heads not divisible by tp={tp}")
    if "-" in pattern:
        need(int(get("intermediate_size")) % tp == 0, f"intermediate_size not divisible by tp={tp}")
    if "E" in pattern:
        need(get("moe_latent_size") is None, "moe_latent_size (latent expert projections)")
        n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
        need(n_group == 1 or topk_group == n_group, "group-limited routing (n_group > 1)")
        need(int(get("n_shared_experts", 1) or 0) == 1,
             "n_shared_experts != 1: transformers sizes the shared expert by moe_shared_expert_intermediate_size "
             "alone, vLLM by its product with n_shared_experts")
        need(int(get("moe_shared_expert_intermediate_size") or 0) % tp == 0,
             f"moe_shared_expert_intermediate_size not divisible by tp={tp}")
        topk, norm = int(get("num_experts_per_tok") or 2), bool(get("norm_topk_prob", True))
        need(norm == (topk > 1), f"norm_topk_prob={norm} with top-k {topk}: Megatron's sigmoid router "
                                 "renormalises exactly when top-k > 1")


# --------------------------------------------------------------------------- model
def mamba_stack_spec(arch: MambaArch) -> Any:
    """The local (non-TE) ``MambaStack`` spec: torch RMSNorms as separate modules, Megatron's
    column/row-parallel linears, local ``DotProductAttention``, ``MLPLayer`` for ``-``,
    ``SequentialMLP`` experts (``get_moe_module_spec(use_te=False, moe_grouped_gemm=False)``) for ``E``.
    The stack is ``MambaStack`` up to 0.17, ``HybridStack`` from 0.18 (:func:`_stack_module`).
    The Mamba pre-norm gets ``arch.norm_epsilon``: up to 0.18 from the spec (``MambaLayer`` passes
    no eps; the TE spec's fused ``in_proj`` norm uses ``layernorm_epsilon``), from 0.19 from
    ``MambaLayer`` itself (``eps=config.layernorm_epsilon``, which :func:`_transformer_config` sets
    to ``arch.norm_epsilon``; a spec eps would collide). The mixer gets ``d_conv = arch.conv_kernel``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = WrappedTorchNorm
    layer_sets_eps = megatron_series() >= (0, 19)
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm if layer_sets_eps else ModuleSpec(module=WrappedTorchNorm,
                                                                params={"eps": arch.norm_epsilon}),
        mixer=ModuleSpec(module=MambaMixer, params={"d_conv": arch.conv_kernel}, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    stack, stack_submodules = _stack_classes()
    submodules = stack_submodules(mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp)
    if arch.num_experts:
        submodules.moe_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=get_moe_module_spec(use_te=False, num_experts=arch.num_experts, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=stack, submodules=submodules)


def _stack_classes() -> tuple[type, type]:
    """(stack, submodules dataclass): ``MambaStack``, ``MambaStackSubmodules`` up to 0.17;
    ``HybridStack``, ``HybridStackSubmodules`` from 0.18."""
    module = _stack_module()
    names = ("HybridStack", "HybridStackSubmodules") if megatron_series() >= (0, 18) else \
        ("MambaStack", "MambaStackSubmodules")
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        import megatron.core

        raise ImportError(f"megatron-core {megatron.core.__version__}: {module.__name__} has no {missing}")
    return getattr(module, names[0]), getattr(module, names[1])


def _transformer_config(arch: MambaArch) -> Any:
    """The ``TransformerConfig`` of ``arch`` under the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, arch.dtype)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, is_hybrid_model=True,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels, ffn_hidden_size=arch.ffn_hidden_size,
        mamba_num_heads=arch.mamba_num_heads, mamba_head_dim=arch.mamba_head_dim,
        mamba_num_groups=arch.mamba_num_groups, mamba_state_dim=arch.mamba_state_dim,
        use_mamba_mem_eff_path=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype, params_dtype=dtype, bf16=arch.dtype == "bfloat16", use_cpu_initialization=True,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=False, activation_func=squared_relu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        **dict.fromkeys(("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                         "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion"), False),
    )
    if arch.num_experts:
        kwargs.update(
            num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_router_topk, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=arch.router_topk_scaling_factor,
            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())
        if arch.shared_expert_ffn:
            kwargs["moe_shared_expert_intermediate_size"] = arch.shared_expert_ffn
    return TransformerConfig(**kwargs)


def build_mamba_model(arch: MambaArch, *, seed: int = 1234) -> MambaModel:
    """Build this rank's shard of a Megatron ``MambaModel`` on CPU (``arch.dtype``, eval mode).

    Uses the current parallel state (:func:`megarefit.demo.megatron_cpu.init_parallel`; the
    tests run tp 1 and 2, pp 1, ep 1 or 2, etp 1 or tp). With pp > 1 ``MambaStack`` keeps its
    stage's slice of ``arch.pattern`` and numbers the layers locally from 0. The default torch
    RNG is seeded from ``seed`` and the pipeline rank. No position embedding;
    ``parallel_output=False``.
    """
    apply_mamba_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.models.mamba import MambaModel

    config = _transformer_config(arch)
    torch.manual_seed(seed + 7919 * ps.get_pipeline_model_parallel_rank())
    model = MambaModel(
        config=config, mamba_stack_spec=mamba_stack_spec(arch), vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_sequence_length, hybrid_override_pattern=arch.pattern,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=False, position_embedding_type="none",
    )
    if arch.dtype != "float32":  # the torch norms and the mixer's A_log / D ignore params_dtype
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(getattr(torch, arch.dtype))
    return model.eval()


@torch.no_grad()
def mamba_forward_logits(model: MambaModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward ``tokens`` ``[batch, seq]`` (int64, identical on every rank) through the model.

    Returns fp32 logits ``[batch, seq, padded_vocab]`` on every TP rank of the last pipeline
    stage (``None`` on other stages). ``MambaModel.forward(input_ids, position_ids,
    attention_mask)`` has ``GPTModel``'s signature, so this is
    :func:`megarefit.demo.megatron_cpu.forward_logits` (causal mask for the ``*`` layers,
    position ids unused) with the Mamba patches in place.
    """
    apply_mamba_cpu_patches()
    return forward_logits(model, tokens)
