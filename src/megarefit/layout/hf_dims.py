"""Reading :class:`~megarefit.layout.dims.ModelDims` fields out of an HF config.

:func:`load_hf_config` accepts the forms a user holds (path, directory, dict,
``PretrainedConfig``); :func:`read_hf_dims` turns one into ``ModelDims`` keyword
arguments, one reader per model feature (attention, MoE, MLA, MTP, hybrid Mamba2,
DSA indexer), each applied when the family's spec says the feature exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from megarefit.errors import ConfigError, MegarefitError, UnsupportedModelError
from megarefit.specs import FamilySpec

BLOCK_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
"""HF ``layers_block_type`` entry -> hybrid layer-pattern letter."""


def load_hf_config(config: str | os.PathLike[str] | Mapping[str, Any] | Any) -> Mapping[str, Any] | Any:
    """Accept a ``config.json`` path, a directory holding one, a dict, or a ``PretrainedConfig``.

    Raises:
        ConfigError: the path does not exist or cannot be read, or holds no JSON object.
    """
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"HF config {path!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"HF config {path!r} cannot be read: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"HF config {path!r} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"HF config {path!r} holds a JSON {type(data).__name__}, not an object")
        return data
    return config


class HFConfigReader:
    """Typed access to one family's HF config (a mapping or an attribute object)."""

    def __init__(self, cfg: Mapping[str, Any] | Any, family: FamilySpec) -> None:
        self.cfg = cfg
        self.family = family

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value of ``key``, or ``default`` when absent."""
        if isinstance(self.cfg, Mapping):
            return self.cfg.get(key, default)
        return getattr(self.cfg, key, default)

    def need(self, key: str) -> int:
        """``key``'s value, a positive integer.

        Raises:
            MegarefitError: the key is missing or not a positive integer.
        """
        value = self.get(key)
        if value is None:
            raise MegarefitError(f"HF config for family {self.family.name} lacks {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MegarefitError(f"HF config for family {self.family.name}: {key} must be a positive integer, got "
                                 f"{value!r}")
        return value

    def flag(self, rule: bool | str) -> bool:
        """A spec flag rule: a constant, or the name of a config key read as a bool (absent: False)."""
        return bool(self.get(rule, False)) if isinstance(rule, str) else rule


def read_hf_dims(cfg: Mapping[str, Any] | Any, fam: FamilySpec) -> dict[str, Any]:
    """``ModelDims`` keyword arguments (all fields) read from HF config ``cfg`` of family ``fam``.

    Raises:
        UnsupportedModelError: the config uses a feature megarefit does not translate.
        MegarefitError: a required key is missing or not a positive integer.
    """
    r = HFConfigReader(text_config(cfg, fam.name) if fam.text_config else cfg, fam)
    for key, value in fam.config_requires:
        if r.get(key, value) != value:
            raise UnsupportedModelError(f"HF config for family {fam.name}: {key}={r.get(key)!r} has no spec table "
                                        f"(megarefit translates {key}={value!r} only)")
    heads, hidden, groups = _attention_heads(r)
    out: dict[str, Any] = {}
    if fam.experts_key is not None and r.get(fam.experts_key):
        out.update(_moe_dims(r))
    if fam.mla:
        out.update(q_lora_rank=int(r.get("q_lora_rank") or 0), kv_lora_rank=r.need("kv_lora_rank"),
                   qk_nope_head_dim=r.need("qk_nope_head_dim"), qk_rope_head_dim=r.need("qk_rope_head_dim"),
                   v_head_dim=r.need("v_head_dim"))
    if fam.mtp_key is not None:
        out["mtp_layers"] = int(r.get(fam.mtp_key) or 0)
    if fam.hybrid:
        out.update(hybrid_dims(fam.name, r.get, r.need))
        if fam.shared_ffn_key and out.get("shared_expert_ffn"):
            out["shared_expert_ffn"] = int(r.get(fam.shared_ffn_key)) * int(r.get(fam.shared_experts_key) or 1)
    if fam.dsa_indexer:
        out.update(_dsa_dims(r, out))
    if fam.gdn:
        out.update(gdn_dims(r))
    if fam.hyper_connections:
        out.update(dsv4_dims(r))
    all_moe = bool(out.get("num_experts")) and not out.get("dense_layers")  # no dense MLP: no intermediate_size
    out.update(_common_dims(r, heads, hidden, groups, out.get("moe_ffn_hidden_size") if all_moe else None))
    return out


def text_config(cfg: Mapping[str, Any] | Any, family: str) -> dict[str, Any]:
    """The language model's config of a vision-language checkpoint: its ``text_config``, with the
    checkpoint's ``tie_word_embeddings`` where ``text_config`` has none.

    Raises:
        MegarefitError: there is no ``text_config``."""
    top = dict(cfg) if isinstance(cfg, Mapping) else cfg.to_dict()
    text = top.get("text_config")
    if text is None:
        raise MegarefitError(f"HF config for family {family} lacks 'text_config' (a vision-language checkpoint "
                             "keeps its language model's config there)")
    text = dict(text) if isinstance(text, Mapping) else text.to_dict()
    if "tie_word_embeddings" in top and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = top["tie_word_embeddings"]
    return text


def gdn_dims(r: HFConfigReader) -> dict[str, Any]:
    """A gated-DeltaNet hybrid's layers and dims (HF Qwen3.5 keys: ``layer_types``, else every
    ``full_attention_interval``-th layer (default 4) full attention; ``linear_num_key_heads``,
    ``linear_key_head_dim``, ``linear_num_value_heads``, ``linear_value_head_dim``,
    ``linear_conv_kernel_dim``; ``shared_expert_intermediate_size``).

    Raises:
        UnsupportedModelError: unknown layer types, dense layers named in an MoE config, attention
            without the output gate or with biases, or value heads that are not a multiple of the
            key heads."""
    name, layers = r.family.name, r.need("num_hidden_layers")
    kinds = r.get("layer_types")
    if kinds is None:
        every = int(r.get("full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(f"HF config for family {name}: layer_types must list 'linear_attention' or "
                                    f"'full_attention' for each of the {layers} layers, got {len(kinds)}: "
                                    f"{sorted(set(map(str, kinds)))}")
    if r.get("mlp_only_layers") or (r.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError(f"HF config for family {name}: mlp_only_layers / decoder_sparse_step name dense "
                                    "layers, which megarefit's gated-DeltaNet tables do not have (every layer of "
                                    "the published Qwen3.5-MoE and Qwen3-Next models is MoE; transformers' and "
                                    "vLLM's Qwen3.5 build no dense layers)")
    if r.get("attn_output_gate", True) is False or r.get("attention_bias"):
        raise UnsupportedModelError(f"HF config for family {name}: full attention without the output gate "
                                    "(attn_output_gate false) or with biases (attention_bias) has no spec table")
    nk, nv = r.need("linear_num_key_heads"), r.need("linear_num_value_heads")
    if nv % nk:
        raise UnsupportedModelError(f"HF config for family {name}: linear_num_value_heads={nv} is not a multiple "
                                    f"of linear_num_key_heads={nk}")
    out = {"linear_layers": tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
           "gdn_key_heads": nk, "gdn_key_dim": r.need("linear_key_head_dim"), "gdn_value_heads": nv,
           "gdn_value_dim": r.need("linear_value_head_dim"), "conv_kernel": r.need("linear_conv_kernel_dim")}
    if r.get("num_experts") and r.get("shared_expert_intermediate_size"):
        out["shared_expert_ffn"] = int(r.get("shared_expert_intermediate_size"))
    return out


def dsv4_dims(r: HFConfigReader) -> dict[str, Any]:
    """DeepSeek-V4's per-layer variants and dims (HF keys ``compress_ratios``, one per decoder layer and
    per MTP layer; ``num_hash_layers``; ``hc_mult``; ``o_groups``, ``o_lora_rank``; ``num_experts_per_tok``;
    ``q_lora_rank``; ``index_n_heads``, ``index_head_dim``).

    Raises:
        UnsupportedModelError: ``compress_ratios`` of the wrong length, with negative entries or more than one
            ratio besides 0 and 4 (each other ratio shapes its compressor differently); heads that do not
            split into ``o_groups``; more hash layers than layers."""
    name, layers = r.family.name, r.need("num_hidden_layers")
    mtp_layers = int(r.get("num_nextn_predict_layers") or 0)
    ratios = [int(x) for x in (r.get("compress_ratios") or [0] * layers)]
    if len(ratios) not in (layers, layers + mtp_layers) or min(ratios, default=0) < 0:
        raise UnsupportedModelError(f"HF config for family {name}: compress_ratios must give a ratio >= 0 for each "
                                    f"of the {layers} layers (and the {mtp_layers} MTP layers), got {len(ratios)}")
    heavy = sorted(set(ratios) - {0, 4})
    if len(heavy) > 1:
        raise UnsupportedModelError(f"HF config for family {name}: compress_ratios {heavy} beside 0 and 4: the "
                                    "spec table has one heavily compressed ratio (128 in the published models)")
    heads, groups = r.need("num_attention_heads"), r.need("o_groups")
    hashed = int(r.get("num_hash_layers") or 0)
    if heads % groups or not 0 <= hashed <= layers:
        raise UnsupportedModelError(f"HF config for family {name}: o_groups={groups} must divide "
                                    f"num_attention_heads={heads}, and num_hash_layers={hashed} be at most {layers}")
    return {"compress_ratios": tuple(ratios[:layers]), "hash_layers": hashed, "hc_mult": r.need("hc_mult"),
            "o_groups": groups, "o_lora_rank": r.need("o_lora_rank"),
            "experts_per_token": r.need("num_experts_per_tok"),
            "q_lora_rank": r.need("q_lora_rank"), "index_n_heads": r.need("index_n_heads"),
            "index_head_dim": r.need("index_head_dim")}


def _attention_heads(r: HFConfigReader) -> tuple[int, int, int]:
    """``(num_attention_heads, hidden_size, num_query_groups)``; the groups default to the heads (MHA)."""
    heads = r.need("num_attention_heads")
    hidden = r.need("hidden_size")
    groups = r.get("num_key_value_heads")
    if groups is None:
        groups = heads  # MHA, as HF reads a config without the key
    elif isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or heads % groups:
        raise MegarefitError(f"HF config for family {r.family.name}: num_key_value_heads must be a positive divisor "
                             f"of num_attention_heads ({heads}), got {groups!r}")
    return heads, hidden, groups


def _common_dims(r: HFConfigReader, heads: int, hidden: int, groups: int, ffn: int | None = None) -> dict[str, Any]:
    """Every family's fields: layers, hidden, heads and query groups, FFN (``ffn`` where the config
    has no ``intermediate_size``: an MoE model without dense layers), vocab, ties and biases."""
    fam = r.family
    tie = r.get("tie_word_embeddings")
    return {
        "family": fam.name,
        "num_layers": r.need("num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "head_dim": int(r.get("head_dim") or hidden // heads),
        "ffn_hidden_size": r.need("intermediate_size") if ffn is None or r.get("intermediate_size") else ffn,
        "vocab_size": r.need("vocab_size"),
        "tie_word_embeddings": fam.tie_word_embeddings_default if tie is None else bool(tie),
        "qkv_bias": r.flag(fam.qkv_bias),
        "proj_bias": r.flag(fam.proj_bias),
        "mlp_bias": r.flag(fam.mlp_bias),
        "qk_norm": r.flag(fam.qk_norm),
    }


def _moe_dims(r: HFConfigReader) -> dict[str, Any]:
    """Routed and shared experts, the router bias and which layers stay dense."""
    fam, get = r.family, r.get
    experts = int(get(fam.experts_key))
    moe_ffn = int(get(fam.moe_ffn_key)) if fam.moe_ffn_key else 0
    layers = r.need("num_hidden_layers")
    dense = set()
    if fam.first_dense_key and get(fam.first_dense_key):
        dense |= set(range(int(get(fam.first_dense_key))))
    if fam.mlp_only_key and get(fam.mlp_only_key):
        dense |= {int(i) for i in get(fam.mlp_only_key)}
    if fam.sparse_step_key and get(fam.sparse_step_key):
        step = int(get(fam.sparse_step_key))
        dense |= {i for i in range(layers) if (i + 1) % step}
    if isinstance(fam.router_bias, tuple):
        bias = get(fam.router_bias[0]) == fam.router_bias[1]
    else:
        bias = fam.router_bias
    kinds = get("mlp_layer_types")  # GLM-5.2 lists them too: they must say what the keys above say
    if kinds is not None and {i for i, kind in enumerate(kinds) if kind == "dense"} != dense:
        raise UnsupportedModelError(f"HF config for family {fam.name}: mlp_layer_types marks layers "
                                    f"{[i for i, kind in enumerate(kinds) if kind == 'dense'][:8]} dense, the "
                                    f"dense-layer keys {sorted(dense)[:8]}: fix the config so that both agree")
    shared = int(get(fam.shared_experts_key) or 0) if fam.shared_experts_key else 0
    renorm = bool(get(*fam.router_renorm)) if isinstance(fam.router_renorm, tuple) else fam.router_renorm
    return {"num_experts": experts, "moe_ffn_hidden_size": moe_ffn, "shared_expert_ffn": shared * moe_ffn,
            "router_bias": bool(bias), "dense_layers": tuple(sorted(dense)), "router_unnormalized": not renorm}


def _dsa_dims(r: HFConfigReader, read: Mapping[str, Any]) -> dict[str, Any]:
    """The DSA lightning indexer (GLM-5); ``read`` holds the fields read so far (the MLA ranks)."""
    name = r.family.name
    out = {"index_n_heads": r.need("index_n_heads"), "index_head_dim": r.need("index_head_dim")}
    if not read.get("q_lora_rank"):
        raise UnsupportedModelError(f"HF config for family {name}: the DSA indexer reads the low-rank "
                                    "query; a config without q_lora_rank is not supported")
    layers = int(r.need("num_hidden_layers"))
    out["shared_indexer_layers"] = tuple(i for i, kind in enumerate(indexer_schedule(name, r.get, layers))
                                         if kind == "shared")
    return out


def hybrid_dims(family: str, get: Any, need: Any) -> dict[str, Any]:
    """A hybrid Mamba2 config's pattern and Mamba dims (HF NemotronH keys: ``hybrid_override_pattern``
    or the ``layers_block_type`` list, ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
    ``ssm_state_size``, ``conv_kernel``).

    Raises:
        UnsupportedModelError: no pattern, an unknown block type, or Mamba projections with biases.
    """
    pattern = get("hybrid_override_pattern")
    if not pattern and get("layers_block_type"):
        kinds = list(get("layers_block_type"))
        unknown = sorted(set(kinds) - set(BLOCK_TYPES))
        if unknown:
            raise UnsupportedModelError(f"HF config for family {family}: layers_block_type {unknown} unknown; "
                                        f"known: {sorted(BLOCK_TYPES)}")
        pattern = "".join(BLOCK_TYPES[k] for k in kinds)
    if not pattern:
        raise UnsupportedModelError(f"HF config for family {family} has no hybrid_override_pattern / "
                                    "layers_block_type")
    if get("mamba_proj_bias") or get("use_bias"):
        raise UnsupportedModelError(f"HF config for family {family}: Mamba projections with biases are not "
                                    "built by Megatron-Core's MambaMixer (bias must be False)")
    return {"layer_pattern": str(pattern), "mamba_heads": need("mamba_num_heads"),
            "mamba_head_dim": need("mamba_head_dim"), "mamba_groups": need("n_groups"),
            "mamba_state": need("ssm_state_size"), "conv_kernel": need("conv_kernel")}


def indexer_schedule(family: str, get: Any, layers: int) -> list[str]:
    """Each decoder layer's DSA indexer, ``"full"`` (its own) or ``"shared"`` (reuses the last full
    layer's top-k; no indexer weights): GLM-5.2's ``indexer_types``, else the schedule transformers
    and vLLM derive, ``index_topk_pattern`` (``"F"`` / ``"S"`` per layer) or every
    ``index_topk_freq``-th layer from ``index_skip_topk_offset`` (0-indexed layer ``i`` is full iff
    ``max(i - offset + 1, 0) % freq == 0``; defaults 1 and 2: every layer full).

    Raises:
        UnsupportedModelError: an unknown kind, a list of the wrong length, a first layer that
            shares (no earlier top-k to reuse), or ``indexer_types`` that disagree with the
            freq / offset / pattern schedule vLLM builds its layers from (names the layers)."""
    derived = _derived_schedule(get, layers)
    given = get("indexer_types")
    kinds = list(given) if given is not None else derived
    where = f"HF config for family {family}"
    if len(kinds) != layers or set(kinds) - {"full", "shared"}:
        raise UnsupportedModelError(f"{where}: indexer_types must list 'full' or 'shared' for each of the "
                                    f"{layers} layers, got {len(kinds)}: {sorted(set(map(str, kinds)))}")
    if kinds and kinds[0] != "full":
        raise UnsupportedModelError(f"{where}: layer 0's indexer is {kinds[0]!r}: a shared layer reuses an "
                                    "earlier full layer's top-k")
    differ = [i for i, (a, b) in enumerate(zip(kinds, derived)) if a != b]
    if differ:
        raise UnsupportedModelError(
            f"{where}: indexer_types disagree with index_topk_freq / index_skip_topk_offset / index_topk_pattern "
            f"at layers {differ[:8]}{' ...' if len(differ) > 8 else ''} (vLLM builds its indexers from the "
            "latter): fix the config so that both say the same")
    return kinds


def index_share_keys(get: Any) -> tuple[int, int]:
    """``(index_topk_freq, index_skip_topk_offset)`` with the defaults transformers and vLLM use (1, 2)."""
    offset = get("index_skip_topk_offset")
    return max(int(get("index_topk_freq") or 1), 1), 2 if offset is None else int(offset)


def _derived_schedule(get: Any, layers: int) -> list[str]:
    """vLLM's schedule: a pattern's ``"S"`` (or ``"shared"``) layers share, every other layer and
    layers past its end have their own; else freq / offset."""
    pattern = get("index_topk_pattern")
    if pattern is not None:
        kinds = [{"S": "shared", "shared": "shared"}.get(str(c), "full") for c in pattern]
        return (kinds + ["full"] * layers)[:layers]
    freq, offset = index_share_keys(get)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


__all__ = ["BLOCK_TYPES", "HFConfigReader", "dsv4_dims", "gdn_dims", "hybrid_dims", "index_share_keys",
           "indexer_schedule", "load_hf_config", "read_hf_dims", "text_config"]
