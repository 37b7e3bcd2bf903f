"""Planners: spec table + dims + a Megatron layout -> validated :class:`~megarefit.plan.Plan` s.

* :mod:`~megarefit.planner.megatron_to_hf`: export, Megatron shards -> full HF tensors (on columns);
* :mod:`~megarefit.planner.hf_to_megatron`: import, full HF tensors -> every rank's shards;
* :mod:`~megarefit.planner.namemap`: global Megatron -> HF name maps and their comparison.

The geometry they share (which rows of which shard land where) is
:mod:`megarefit.layout.geometry`; plans for one vLLM worker's own shards are
:mod:`megarefit.targets`.
"""

from megarefit.planner.hf_to_megatron import plan_hf_to_megatron
from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

__all__ = ["plan_hf_to_megatron", "plan_megatron_to_hf"]

# Names megarefit 0.1's ``megarefit.planner`` module held, now in the layout layer or a
# submodule: importable from here for one release, with a DeprecationWarning (CHANGELOG.md).
_MOVED_NAMES = {
    **dict.fromkeys(("Piece", "SourceTensor", "global_shape", "grouped_boxes", "grouped_pieces", "hf_shapes",
                     "local_shape", "pieces", "source_tensors", "view_shape"), "megarefit.layout.geometry"),
    **dict.fromkeys(("check_ranks", "resolve_layer_spec"), "megarefit.layout.shards"),
    "plan_export": "megarefit.planner.megatron_to_hf",
}


def __getattr__(name: str) -> object:
    module = _MOVED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'megarefit.planner' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"megarefit.planner.{name} moved to {module}.{name}; the old path is removed in megarefit 0.3",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
