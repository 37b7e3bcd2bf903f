"""Megatron-Core releases as data: which layout facts hold on each, which config flags matter.

Parameter names and layouts move between Megatron-Core releases. Each fact that differs is
a :class:`~megarefit.specs.table.Condition` that spec-table rows require, and each release
(:class:`MegatronRelease`) lists the facts that hold on it::

    fact                     0.16  0.17  0.18  0.19   what differs
    mtp_transformer_layer     x                        mtp.layers.{i}.transformer_layer.*
    mtp_model_layer                 x     x     x      mtp.layers.{i}.mtp_model_layer.*
    dsa_rope_last             x     x     x            DSA indexer head [nope; rope] (HF: [rope; nope])
    dsa_rope_first                              x      DSA indexer head [rope; nope], as HF
    mamba_conv_module         x     x     x            mixer.conv1d.weight / .bias  (an nn.Conv1d)
    mamba_conv_params                           x      mixer.conv1d_weight / conv1d_bias
    legacy GroupedMLP         x                        mlp.experts.weight1 / weight2 (removed in 0.17)

A release also names the ``TransformerConfig`` flags (:class:`ConfigFlag`,
:mod:`megarefit.specs.megatron_flags`) whose value changes what a stored parameter means or the
function the model computes (norm conventions, fused or interleaved weights, the router, muP
scaling, the DSA indexer's RoPE): megarefit translates the values it has verified for the model
(:class:`ModelNeeds`) and refuses the others, by name.

:class:`MegatronCore` is one trainer's record, the version and those flags' values, as the
Publisher writes it into its manifest. A version that no release lists as verified is refused,
naming the verified ones; ``assume`` reads it as one of them, explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megarefit.errors import MegarefitError, UnverifiedMegatronError
from megarefit.specs.megatron_flags import (
    FLAGS_016,
    FLAGS_017,
    FLAGS_018,
    FLAGS_019,
    ConfigFlag,
    Feature,
    ModelNeeds,
    plain,
)
from megarefit.specs.table import Condition

ASSUME_ENV = "MEGAREFIT_ASSUME_MEGATRON"
"""Environment variable read by :meth:`MegatronCore.detect`: a verified version to read an
unverified installed one as (``MEGAREFIT_ASSUME_MEGATRON=0.19.2`` for a 0.19.3 trainer)."""


@dataclass(frozen=True)
class MegatronRelease:
    """One Megatron-Core release series (``"0.19"``) as megarefit knows it.

    Attributes:
        series: ``"major.minor"``.
        verified: exact versions whose layouts CI checks against real Megatron-Core.
        facts: the layout facts (conditions) that hold on this series.
        flags: the config flags that matter on this series.
        grouped_mlp: legacy ``GroupedMLP`` (``moe_grouped_gemm`` without TE) exists.
    """

    series: str
    verified: tuple[str, ...]
    facts: frozenset[Condition]
    flags: tuple[ConfigFlag, ...] = ()
    grouped_mlp: bool = False


_C = Condition
_LATE_DSA = frozenset({_C.MTP_MODEL_LAYER, _C.DSA_ROPE_LAST, _C.MAMBA_CONV_MODULE})

RELEASES: tuple[MegatronRelease, ...] = (
    MegatronRelease("0.16", ("0.16.1",), frozenset({_C.MTP_TRANSFORMER_LAYER, _C.DSA_ROPE_LAST,
                                                    _C.MAMBA_CONV_MODULE}), FLAGS_016, grouped_mlp=True),
    MegatronRelease("0.17", ("0.17.1",), _LATE_DSA, FLAGS_017),
    MegatronRelease("0.18", ("0.18.2",), _LATE_DSA, FLAGS_018),
    MegatronRelease("0.19", ("0.19.2",), frozenset({_C.MTP_MODEL_LAYER, _C.DSA_ROPE_FIRST, _C.MAMBA_CONV_PARAMS}),
                    FLAGS_019),
)
VERIFIED_VERSIONS: tuple[str, ...] = tuple(v for r in RELEASES for v in r.verified)
REFERENCE_VERSION = "0.16.1"
"""megarefit's reference layout: what a :class:`~megarefit.layout.SourceLayout` names unless told."""


def release_of(version: str) -> MegatronRelease:
    """The release a verified ``version`` belongs to (a local label, ``0.19.2+b0df788``, is ignored:
    megatron-core 0.18+ append the git HEAD of the work tree it is installed in).

    Raises:
        UnverifiedMegatronError: ``version`` is not in :data:`VERIFIED_VERSIONS`.
    """
    public = version.split("+", 1)[0]  # 0.18+ append "+<git HEAD>" when installed inside a git work tree
    for rel in RELEASES:
        if public in rel.verified:
            return rel
    raise UnverifiedMegatronError(
        f"megatron-core {version} is not a version megarefit has verified; verified: {list(VERIFIED_VERSIONS)}. "
        f"Run a verified one, or read it as one explicitly (MegatronCore(..., assume='0.19.2') or "
        f"{ASSUME_ENV}=0.19.2) if you know its layouts are that version's")


@dataclass(frozen=True)
class MegatronCore:
    """A trainer's Megatron-Core: its version and the config flags that decide layouts.

    Attributes:
        version: ``megatron.core.__version__`` of the trainer.
        flags: ``(name, value)`` of the release's :class:`ConfigFlag` s, as read from the
            model's ``TransformerConfig``; a flag not listed (or ``None``: none read) is refused
            by :meth:`check` for a model it matters for.
        assume: a verified version to read ``version`` as (explicit opt-in for unverified
            patch releases); ``None``: ``version`` itself must be verified.
        table_flags: no trainer's config was read: the record states a layout megarefit builds
            for whichever model is planned (:data:`REFERENCE`, :meth:`verified` without a model),
            every flag at the value that model needs; :meth:`check` checks the version only.
    """

    version: str
    flags: tuple[tuple[str, Any], ...] | None = None
    assume: str | None = None
    table_flags: bool = False

    @property
    def release(self) -> MegatronRelease:
        """Raises :class:`UnverifiedMegatronError` (see :func:`release_of`)."""
        return release_of(self.assume or self.version)

    @classmethod
    def from_config(cls, version: str, config: Any, *, assume: str | None = None) -> MegatronCore:
        """Read the release's flags from a ``TransformerConfig`` (or any object with those attributes;
        a missing attribute stays unread; a callable is recorded by its ``__name__``).

        Raises:
            UnverifiedMegatronError: see :attr:`release`.
        """
        rel = release_of(assume or version)
        flags = tuple((f.name, plain(getattr(config, f.name))) for f in rel.flags if hasattr(config, f.name))
        return cls(version, flags, assume)

    @classmethod
    def verified(cls, version: str, needs: ModelNeeds | None = None) -> MegatronCore:
        """A trainer on verified ``version`` with every flag of its release at the first value verified
        for the model ``needs`` describes (a flag with none is left unread). Without ``needs``: each
        flag at its default first value, read as :attr:`table_flags` (what ``megarefit plan
        --megatron-version`` plans for: the trainer the tables need, for any model).

        Raises:
            UnverifiedMegatronError: see :func:`release_of`.
        """
        flags = release_of(version).flags
        if needs is None:
            return cls(version, tuple((f.name, f.verified[0]) for f in flags), table_flags=True)
        return cls(version, tuple((f.name, needs.verified(f)[0]) for f in flags if needs.verified(f)))

    @classmethod
    def detect(cls, config: Any = None) -> MegatronCore:
        """The ``megatron.core`` this process has imported (flags from ``config`` when given; else
        not read, so refused where they matter; on megarefit's reference release
        :data:`REFERENCE_VERSION` read as :attr:`table_flags`, as every 0.16.1 layout was before its
        flags were checked), honouring :data:`ASSUME_ENV`.

        Raises:
            UnverifiedMegatronError: megatron.core is not imported, or its version is unverified.
        """
        import sys

        core = sys.modules.get("megatron.core")
        if core is None:
            raise UnverifiedMegatronError("megatron.core is not imported in this process: pass megatron="
                                          "MegatronCore(version, ...) naming the trainer's version")
        assume = os.environ.get(ASSUME_ENV) or None
        if config is not None:
            return cls.from_config(core.__version__, config, assume=assume)
        release_of(assume or core.__version__)
        if (assume or core.__version__.split("+", 1)[0]) == REFERENCE_VERSION:
            return cls(core.__version__, (), assume, table_flags=True)
        return cls(core.__version__, None, assume)

    @classmethod
    def in_process(cls) -> MegatronCore:
        """:meth:`detect` where this process imported ``megatron.core``; else :data:`REFERENCE`
        (tensors that did not come from Megatron-Core are read in megarefit's reference layout)."""
        import sys

        return cls.detect() if "megatron.core" in sys.modules else REFERENCE

    def facts(self) -> frozenset[Condition]:
        return self.release.facts

    def check(self, needs: ModelNeeds, *, expert_layout: str = "sequential", model: str = "") -> None:
        """Refuse what this release cannot hand megarefit exactly, for a model that ``needs`` describes
        (:meth:`~megarefit.layout.dims.ModelDims.megatron_needs`).

        Raises:
            UnverifiedMegatronError: the version is unverified; a flag that matters for the model
                holds a value not verified for it (naming the flag, the value, the release and the
                value to set), or was not read; legacy ``GroupedMLP`` asked of a release without it.
        """
        rel = self.release
        where = f"megatron-core {self.version}" + (f" (read as {self.assume})" if self.assume else "")
        if expert_layout == "legacy_grouped" and not rel.grouped_mlp:
            raise UnverifiedMegatronError(f"{where}: legacy GroupedMLP (expert_layout='legacy_grouped') was "
                                          "removed in megatron-core 0.17; use 'sequential' or 'te_grouped'")
        if self.table_flags:
            return
        wanted = needs.wanted(rel.flags)
        values = dict(self.flags or ())
        unread = [f.name for f in wanted if f.name not in values]
        if unread:
            raise UnverifiedMegatronError(
                f"{where}: the config flags {unread} decide how {model or 'this model'} is laid out, and were not "
                "read; pass megatron=megatron_core_of(model) (megarefit.integrations.megatron) or "
                "MegatronCore.from_config(megatron.core.__version__, model.config)")
        for flag in wanted:
            value, ok = values[flag.name], needs.verified(flag)
            if value not in ok:
                fix = (f"set {flag.name}={ok[0]!r} in the trainer's TransformerConfig" if ok else
                       "no value of it is verified for this model")
                raise UnverifiedMegatronError(
                    f"{where}: {flag.name}={value!r} is refused for {model or 'this model'}: it {flag.why}; "
                    f"verified for it: {list(ok)}; {fix}")

    def to_dict(self) -> dict[str, Any]:
        out = {"version": self.version, "flags": None if self.flags is None else [list(f) for f in self.flags],
               "assume": self.assume}
        return out | ({"table_flags": True} if self.table_flags else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MegatronCore:
        """Raises :class:`~megarefit.errors.MegarefitError` on a malformed record."""
        flags = data.get("flags")
        if not isinstance(data.get("version"), str) or not (flags is None or isinstance(flags, list)):
            raise MegarefitError(f"malformed megatron-core record {str(data)[:200]}")
        return cls(data["version"], None if flags is None else tuple((str(k), v) for k, v in flags),
                   data.get("assume"), bool(data.get("table_flags", False)))


REFERENCE = MegatronCore(REFERENCE_VERSION, (), table_flags=True)

__all__ = ["ASSUME_ENV", "REFERENCE", "REFERENCE_VERSION", "RELEASES", "VERIFIED_VERSIONS", "ConfigFlag",
           "Feature", "MegatronCore", "MegatronRelease", "ModelNeeds", "UnverifiedMegatronError", "release_of"]
