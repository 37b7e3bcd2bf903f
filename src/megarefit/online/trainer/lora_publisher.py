"""LoraPublisher (trainer side): serve one rank's LoRA adapter shards for an adapter-only refit.

A LoRA policy trains only its adapters; between RL steps the engines need those alone (a few MB to
a few GB), installed into their LoRA layers (:mod:`megarefit.integrations.vllm_lora`). A
:class:`LoraPublisher` is a :class:`~megarefit.online.trainer.publisher.Publisher` whose served
tensors are this rank's adapter shards (``<linear>.adapter.linear_in.weight`` ...,
:mod:`megarefit.specs.lora`) instead of the model's weights. So the fence, the seqlock of
``updating``, acknowledgements and checksums are the full refit's, unchanged::

    adapters = Rendezvous(...).channel("lora/policy")   # its own records, beside the model's
    pub = LoraPublisher(params, hf_config, rank=(tp_rank, stage, 0), layout=layout, rendezvous=adapters,
                        alpha=32, base=base_params)
    with pub.updating(step + 1):
        optimizer.step()

Its manifest carries a :class:`~megarefit.transport.manifest.LoraInfo` (``r``, ``alpha``, the base
version the adapter trains on), which the receiver turns into PEFT's ``peft_config``.

**The base under the adapter.** An adapter is only right on the base it was trained on. ``base`` (the
rank's other parameters, frozen) is fingerprinted when the publisher is built (per tensor, its bytes
summed as 64-bit words: one pass at memory speed) and again by every publish. If it changed, the
publish raises :class:`~megarefit.errors.BaseChangedError` and the rank stays marked writing: the base
must be refit first (a full refit of it), then a new publisher made with that refit's ``base_version``.
Receivers refuse an adapter whose ``base_version`` is not the one their engine holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from megarefit.errors import BaseChangedError, LayoutError, MegarefitError, MissingParameterError, ShapeMismatchError
from megarefit.layout.lora import adapter_global_shape, adapter_local_shape
from megarefit.online.trainer.lora_merge import adapter_alpha_dim
from megarefit.online.trainer.publisher import Publisher, tensor_entry
from megarefit.planner.lora_to_peft import adapter_rows
from megarefit.specs.lora import Factor, is_adapter, peft_row
from megarefit.transport.manifest import LoraInfo, TensorEntry


def _word_sums(t: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64: the tensor's bytes summed as 64-bit words (wrapping), and its last bytes (past a
    multiple of 8) summed. A change detector, one pass at memory speed (a changed word changes it; a
    permutation of words does not), not a hash."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    n8 = raw.numel() // 8 * 8
    try:
        words = raw[:n8].view(torch.int64)
    except RuntimeError:  # storage not 8-byte aligned
        words = raw[:n8].clone().view(torch.int64)
    return torch.stack([words.sum(), raw[n8:].sum(dtype=torch.int64)])


def _fingerprint(base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per tensor, :func:`_word_sums`, brought to the host in one copy per device (one wait)."""
    per_device: dict[torch.device, list[str]] = {}
    for n, t in base.items():
        per_device.setdefault(t.device, []).append(n)
    out: dict[str, torch.Tensor] = {}
    for names in per_device.values():
        sums = torch.stack([_word_sums(base[n]) for n in names]).cpu()
        out.update(zip(names, sums))
    return out


class LoraPublisher(Publisher):
    """Serves one trainer rank's LoRA adapter shards; see the module docstring.

    Args:
        params: the rank's parameters by name (``named_parameters()``): adapter parameters are served,
            the rest ignored (pass them as ``base``).
        hf_config, rank, layout, rendezvous: as :class:`Publisher` (``layout.ep == 1``; give a
            rendezvous of the adapter's own, :meth:`Rendezvous.channel`, so its records do not meet the
            model's).
        alpha: LoRA's ``alpha`` (the adapter scales ``B @ A`` by ``alpha / r``); ``r`` is read from the shards.
        base: the base tensors under the adapter on this rank (frozen), fingerprinted at every publish;
            ``"params"`` (default): every other tensor of ``params``; ``None``: not checked (then nothing
            stops an adapter from being served on a changed base).
        base_version: the version of the base the engines hold under this adapter (a full refit's), or -1
            for the checkpoint both sides loaded.
        checksums, snapshot, agent_name, ipc, ddp: as :class:`Publisher` (no FP8, no delta: adapters are small).

    Raises:
        UnsupportedAdapterError / UnknownParameterError: an adapter megarefit refuses or does not know.
        LayoutError: no adapter parameter; layers carry different adapters; ``ep > 1``.
        ShapeMismatchError: a shard's shape is not what ``r`` and ``layout.tp`` imply, or the shards
            disagree on ``r``.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], hf_config: Any, *, rank: tuple[int, int, int],
                 layout: Any, rendezvous: Any, alpha: float, base: Mapping[str, torch.Tensor] | str | None = "params",
                 base_version: int = -1, **options: Any):
        for refused in ("quantization", "delta", "tracker"):
            if options.get(refused):
                raise MegarefitError(f"LoraPublisher takes no {refused}= (adapters are served as trained, whole)")
        if layout.ep != 1:
            raise LayoutError(f"LoraPublisher serves ep=1 trainers (expert adapters are refused), got ep={layout.ep}")
        self.alpha, self.base_version = float(alpha), int(base_version)
        self.r = 0  # read from the shards by _expected
        if isinstance(base, str) and base != "params":
            raise MegarefitError(f"base={base!r}: give the base tensors, 'params' (the others of params) or None")
        self.base = {n: p for n, p in params.items() if not is_adapter(n)} if base == "params" else (
            None if base is None else dict(base))
        self._base_sums = _fingerprint(self.base) if self.base is not None else None
        self.last_base_check_s = 0.0
        adapters = {n: p for n, p in params.items() if is_adapter(n)}
        if not adapters:
            raise LayoutError(f"rank {tuple(rank)}: no LoRA adapter parameter (``.adapter.`` names) among "
                              f"{len(params)} parameters: is Bridge's LoRA applied?")
        super().__init__(adapters, hf_config, rank=rank, layout=layout, rendezvous=rendezvous, quantization=None,
                         **options)

    @classmethod
    def from_megatron(cls, model: Any, hf_config: Any, *, rendezvous: Any, base_version: int = -1,
                      **options: Any) -> Any:
        """Serve this rank's Bridge LoRA adapters (``LoRA`` / ``CanonicalLoRA`` applied to a Megatron-Core
        model): the layout read from Megatron as :meth:`Publisher.from_megatron` reads it, ``alpha`` from the
        adapter modules, the base fingerprinted (``base="params"``). Data-parallel copy 0 alone serves (an
        adapter is small: nothing to spread); the other copies get an empty ``PublisherGroup``.

        Raises:
            LayoutError: no adapter module, or adapters that disagree on ``alpha`` / ``dim``.
            and what :meth:`Publisher.from_megatron` and the constructor raise."""
        alpha, _ = adapter_alpha_dim(model)
        return super().from_megatron(model, hf_config, rendezvous=rendezvous, serve_copies=False, alpha=alpha,
                                     base_version=base_version, **options)

    def _expected(self) -> dict[str, Any]:
        """Per adapter name, ``(row, global shape)``; the shards checked against one ``r`` and ``layout.tp``."""
        found: dict[str, Any] = {}
        ranks: dict[int, str] = {}  # adapter rank r -> a tensor that has it
        for name, p in self.params.items():
            row, _ = peft_row(name)  # MoE adapters refused here first, named
            a = row.factor is Factor.A  # A [r/tp, in] of a column base (the gathered A), [r, in/tp] of a row base
            ranks.setdefault(p.shape[0] * (self.layout.tp if row.gathered else 1) if a else p.shape[1], name)
            found[name] = row
        if len(ranks) != 1:
            raise ShapeMismatchError(f"rank {self.rank}: adapters of more than one rank r (at tp={self.layout.tp}): "
                                     + ", ".join(f"r={r} in {n}" for r, n in sorted(ranks.items())))
        rows = adapter_rows(list(found))  # the same wrapped linears on every layer that has any
        want = {row.megatron.format(layer=n) for row in rows for n in range(self.layout.stage_layers[self.rank.pp])}
        if want != set(found):
            raise MissingParameterError(
                f"rank {self.rank}: every layer of its stage ({self.layout.stage_layers[self.rank.pp]} layers) must "
                f"carry the same adapters; absent: {sorted(want - set(found))[:3]}, past the stage's layers: "
                f"{sorted(set(found) - want)[:3]}")
        self.r = next(iter(ranks))
        out = {}
        for name, row in found.items():
            want = adapter_local_shape(row, self.dims, self.r, self.layout.tp, name=name)
            p = self.params[name]
            if tuple(p.shape) != want or not p.is_contiguous():
                raise ShapeMismatchError(f"adapter {name} on rank {self.rank}: expected contiguous {want} "
                                         f"(r={self.r}, tp={self.layout.tp}), got {tuple(p.shape)}")
            out[name] = (row, adapter_global_shape(row, self.dims, self.r))
        return out

    def _served(self, expected: Mapping[str, Any]) -> tuple[list[TensorEntry], list[torch.Tensor]]:
        entries, served = [], []
        for name, (row, gshape) in expected.items():
            tensor = self.snapshot.get(name, self.params[name])
            entries.append(tensor_entry(name, row.role.value, tensor, gshape))
            served.append(tensor)
        return entries, served

    @property
    def lora(self) -> LoraInfo:  # type: ignore[override]
        return LoraInfo(self.r, self.alpha, self.base_version)

    def _settle(self, version: int) -> None:
        self.check_base()
        super()._settle(version)

    def check_base(self) -> None:
        """Fingerprint ``base`` again (``last_base_check_s``: the seconds it took).

        Raises:
            BaseChangedError: a base tensor changed since the publisher was built (names it), or is gone."""
        if self._base_sums is None or self.base is None:
            return
        t0 = time.perf_counter()
        gone = sorted(set(self._base_sums) - set(self.base))
        if gone:
            raise MissingParameterError(f"base tensors {gone[:3]} of rank {self.rank} are gone")
        now = _fingerprint({n: self.base[n] for n in self._base_sums})
        for name, was in self._base_sums.items():
            if not torch.equal(now[name], was):
                raise BaseChangedError(
                    f"base tensor {name} on rank {self.rank} changed since this LoraPublisher was built (base "
                    f"version {self.base_version}): the engines' base no longer matches the adapter. Refit the base "
                    "first (a full refit), then serve the adapter from a new LoraPublisher(base_version=<that "
                    "refit's version>)")
        self.last_base_check_s = time.perf_counter() - t0


__all__ = ["LoraPublisher"]
