"""Layout: what the numbers of a model and a parallel layout imply, as pure functions.

* :mod:`~megarefit.layout.dims`: :class:`ModelDims` from an HF config;
* :mod:`~megarefit.layout.parallel`: :class:`RankCoord`, :class:`Box`, :class:`SourceLayout`
  (a trainer's TP/PP/EP/ETP layout);
* :mod:`~megarefit.layout.geometry`: where each row of a sharded tensor lands in the HF
  tensors (pieces, grouped-expert boxes, local / view / HF shapes, every rank's tensors);
* :mod:`~megarefit.layout.megatron_model`: a live Megatron-Core model's layout, read from Megatron
  (``parallel_state``, ``TransformerConfig``), or stated by hand (:func:`source_layout`);
* :mod:`~megarefit.layout.shards`: a set of shard names checked against a layout;
* :mod:`~megarefit.layout.classify`: roles of a live Megatron model, checked three ways.
"""

from megarefit.layout.dims import DEFAULT_VOCAB_DIVISOR, ModelDims, load_hf_config
from megarefit.layout.parallel import Box, ExpertLayout, LayerSpec, RankCoord, SourceLayout, virtual_stage

__all__ = ["DEFAULT_VOCAB_DIVISOR", "Box", "ExpertLayout", "LayerSpec", "ModelDims", "RankCoord", "SourceLayout",
           "load_hf_config", "virtual_stage"]
