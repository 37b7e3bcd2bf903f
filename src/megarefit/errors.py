"""Exception types.

Every error raised on bad input names what is wrong in the caller's terms: the
tensor name, the Megatron rank ``(tp, pp, ep)``, and expected vs actual values.
All derive from :class:`MegarefitError`, which derives from ``ValueError`` so
callers that only know the standard hierarchy still catch them.
"""

from __future__ import annotations


class MegarefitError(ValueError):
    """Base class of every megarefit error."""


class ConfigError(MegarefitError):
    """An HF config cannot be read: the file does not exist or is not a JSON object."""


class UnsupportedModelError(MegarefitError):
    """The HF config names an architecture / ``model_type`` with no spec table."""


class UnsupportedAdapterError(UnsupportedModelError):
    """A PEFT adapter megarefit cannot refit exactly (DoRA; adapters on experts, the router, MLA,
    Mamba); the message names the module, why, and what to train instead."""


class BaseChangedError(MegarefitError):
    """A LoRA adapter refit was asked for while the base weights under the adapter differ from what the
    engines hold (changed on the trainer since the adapter publisher was built, or another base version):
    the base must be refit first."""


class SpecTableError(MegarefitError):
    """A spec table is malformed (unknown placeholder, overlapping entries, ...)."""


class UnknownParameterError(MegarefitError):
    """A Megatron parameter name matches no spec-table entry."""


class AmbiguousParameterError(MegarefitError):
    """A Megatron parameter name matches more than one active spec-table entry."""


class MissingParameterError(MegarefitError):
    """A tensor the layout requires is absent (on a given rank, or in an HF state)."""


class UnexpectedParameterError(MegarefitError):
    """A tensor is present that the layout does not expect (e.g. wrong rank or spelling)."""


class ShapeMismatchError(MegarefitError):
    """A tensor's shape (or dtype) differs from what the config and layout imply."""


class UnverifiedMegatronError(MegarefitError):
    """A Megatron-Core version, or a config flag value, megarefit has not verified
    (:mod:`megarefit.specs.megatron_core` lists the verified ones)."""


class DependencyError(MegarefitError):
    """An installed package megarefit calls cannot be used as installed (e.g. a torchvision
    built for another torch makes transformers' model classes fail to import); the message
    names the package, both versions and the command that fixes it."""


class LayoutError(MegarefitError):
    """Parallel sizes are invalid for the model, or ranks are missing / extra."""


class PlanValidationError(MegarefitError):
    """A plan fails validation: out-of-bounds box, overlap, or incomplete cover."""


class NoHolderError(MegarefitError):
    """Every trainer rank holding a source tensor is excluded (failed): nothing can serve it."""


class ClassificationError(MegarefitError):
    """A live Megatron model disagrees with the spec table on parameter roles."""
