"""Multi-token-prediction (MTP) rows: DeepSeek-V3 / GLM-4.5 ``num_nextn_predict_layers``.

Megatron-Core (``mtp_num_layers``, ``MultiTokenPredictionLayer``) keeps each MTP
layer on the last pipeline stage; HF checkpoints store MTP layer i after the
decoder, as layer ``num_hidden_layers + i``::

    Megatron mtp.layers.{i}.                       HF model.layers.{N+i}.
    enorm.weight                               ->  enorm.weight              [hidden]   (norm of the embedding)
    hnorm.weight                               ->  hnorm.weight              [hidden]   (norm of the hidden state)
    eh_proj.weight                             ->  eh_proj.weight            [hidden, 2*hidden]  column-parallel
    final_layernorm.weight                     ->  shared_head.norm.weight   [hidden]
    transformer_layer.<decoder-layer param>    ->  <same HF name as in a decoder layer>
    (mtp_model_layer.<...> from megatron-core 0.17 on)

``eh_proj`` reads ``cat(enorm(embedding), hnorm(hidden))`` in both; block-FP8
checkpoints keep it unquantized (vLLM's drafters hold it as a plain ``nn.Linear``). The MTP block
shares the model's embedding and output layer (with pp > 1 the last stage holds a
kept-in-sync copy of the embedding, a duplicate); DeepSeek-V3 checkpoints also
carry copies of them as ``model.layers.{N+i}.embed_tokens`` / ``shared_head.head``,
which megarefit neither exports nor needs on import.
"""

from __future__ import annotations

import dataclasses

from megarefit.specs.table import MTP_PREFIX, Condition, ParamSpec, Role

_M = MTP_PREFIX + "{layer}."
_H = "model.layers.{layer}."

MTP_OWN = (
    ParamSpec(_M + "enorm.weight", Role.REPLICATED, (_H + "enorm.weight",), ("hidden",)),
    ParamSpec(_M + "hnorm.weight", Role.REPLICATED, (_H + "hnorm.weight",), ("hidden",)),
    # not block-FP8 quantized: vLLM's and SGLang's MTP drafters build eh_proj as a plain
    # nn.Linear with no quantization method, so FP8 checkpoints keep it in the model dtype
    ParamSpec(_M + "eh_proj.weight", Role.COLUMN, (_H + "eh_proj.weight",), ("hidden", "2hidden"), linear=False),
    ParamSpec(_M + "final_layernorm.weight", Role.REPLICATED, (_H + "shared_head.norm.weight",), ("hidden",)),
)


MTP_INNER = (("transformer_layer.", Condition.MTP_TRANSFORMER_LAYER), ("mtp_model_layer.", Condition.MTP_MODEL_LAYER))
"""The MTP layer's decoder layer, as each Megatron-Core release names it (0.16; 0.17+)."""


def mtp_rows(entries: tuple[ParamSpec, ...]) -> tuple[ParamSpec, ...]:
    """MTP rows for a family whose table is ``entries``: the MTP-only tensors, and every
    decoder-layer row again under ``mtp.layers.{layer}.transformer_layer.`` (megatron-core 0.16)
    and ``mtp.layers.{layer}.mtp_model_layer.`` (0.17+)."""
    layer = [dataclasses.replace(r, megatron=r.megatron.replace("decoder.layers.{layer}.", _M + inner, 1),
                                 requires=r.requires | {fact})
             for inner, fact in MTP_INNER for r in entries if r.megatron.startswith("decoder.layers.{layer}.")]
    return MTP_OWN + tuple(layer)
