"""Families megarefit knows and cannot yet translate exactly: refused in one line naming what is
missing, never guessed (data; :func:`megarefit.specs.family_for_config` reads it).

Each entry says which of the family's weights have no spec table yet (checkpoint names, as the
published checkpoints spell them), and, where it decides the matter, that no Megatron-Core release
megarefit tests (0.16-0.19) builds them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """A family refused until its spec table is verified.

    Attributes:
        name: the family, as users know it.
        architectures: HF ``architectures[0]`` values it covers.
        model_types: HF ``model_type`` values it covers.
        missing: what megarefit cannot translate yet (one clause, no trailing period).
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    missing: str


PENDING: tuple[Pending, ...] = ()
"""None today: DeepSeek-V4, the last entry, has its table (:mod:`megarefit.specs.deepseek_v4`)."""


def pending_for(architecture: str | None, model_type: str | None) -> Pending | None:
    """The :data:`PENDING` entry naming ``architecture`` (or, without one, ``model_type``), if any."""
    for entry in PENDING:
        if architecture in entry.architectures or (architecture is None and model_type in entry.model_types):
            return entry
    return None


__all__ = ["PENDING", "Pending", "pending_for"]
