"""Kernels and a receiver on a CUDA device that is not the process's current one.

Triton launches on the *current* device: without a guard, a ``RefitReceiver(device="cuda:1")``
in a process whose current device is ``cuda:0`` fails on its first cycle ("Pointer argument
(at 0) cannot be accessed from Triton (cpu tensor?)"). Every launch runs under
``torch.cuda.device(tensor.device)`` (:func:`megarefit.cuda.kernel_device`). Needs two GPUs
(skipped with fewer); nothing here calls ``set_device`` to the receiver's device.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

from megarefit.quant.fp8 import FP8_DTYPE, Fp8Format, quantize_fp8  # noqa: E402
from megarefit.quant.kernel import Fp8Quantizer  # noqa: E402
from megarefit.transport.boxcopy import BoxCopies  # noqa: E402

OTHER = torch.device("cuda:1")


@pytest.fixture(autouse=True)
def current_is_cuda0():
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)  # the process's current device is NOT the tensors' device
    yield
    torch.cuda.set_device(before)


def test_box_copies_launch_on_the_tensors_device():
    src = torch.randn(64, 512, dtype=torch.bfloat16, device=OTHER)
    dst = torch.zeros(64, 512, dtype=torch.bfloat16, device=OTHER)
    pairs = [(dst[:, :128], src[:, 256:384]), (dst[:, 128:384], src[:, :256])]  # strided boxes
    copies = BoxCopies(pairs)
    assert copies.fused
    copies()
    torch.cuda.synchronize(OTHER)
    assert torch.cuda.current_device() == 0
    assert torch.equal(dst[:, :128], src[:, 256:384]) and torch.equal(dst[:, 128:384], src[:, :256])
    assert not dst[:, 384:].any()


def test_fp8_quantizer_launches_on_the_tensors_device():
    fmt = Fp8Format()
    src = torch.randn(384, 256, dtype=torch.bfloat16, device=OTHER)
    out = torch.empty(src.shape, dtype=FP8_DTYPE, device=OTHER)
    scale = torch.empty(fmt.scale_shape(tuple(src.shape)), dtype=torch.float32, device=OTHER)
    quantizer = Fp8Quantizer([(src, out, scale)], fmt)
    assert quantizer.fused
    quantizer()
    want, want_scale = quantize_fp8(src.cpu(), fmt)
    assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale.cpu(), want_scale)


def expected(hf: dict[str, torch.Tensor], quantization: str | None) -> dict[str, torch.Tensor]:
    """What the receiver must hold: the HF state the shards were cut from, or its block-FP8
    checkpoint made by vLLM's own quantizer (every attention / MLP projection, 128x128 blocks)."""
    from reference import block_fp8, vllm_fp8_checkpoint  # no vLLM on the GPU machines

    return hf if quantization is None else vllm_fp8_checkpoint(hf, {n for n in hf if n.endswith("_proj.weight")},
                                                                 quantize=block_fp8)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_receiver_on_a_non_current_device(config, quantization):
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    shards = {r: {n: t.to("cuda:0").contiguous() for n, t in s.items()}
              for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    want = expected(hf, quantization)
    job = f"guard-{quantization}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-{r[0]}", quantization=quantization) for r, s in shards.items()]
    receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=30, device="cuda:1")
    for version in (1, 2):  # cold, then warm (prepared READs and kernels reused)
        for p in pubs:
            p.publish(version)
        got = dict(receiver.run_refit_cycle(version))
        assert torch.cuda.current_device() == 0
        assert got.keys() == want.keys()
        for k, t in got.items():
            assert t.device == OTHER and torch.equal(t.cpu().view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_streamed_receiver_on_a_non_current_device(config, quantization):
    """A streamed refit (budget 60% of the bf16 share: several groups through one ring) into ``cuda:1`` while
    ``cuda:0`` is current: every group lands on the receiver's device, bit for bit, and this
    process allocates nothing on ``cuda:0``."""
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    cpu_shards = reference_shards(hf, cfg, tp=2, pp=1)
    want = expected(hf, quantization)
    shards = {r: {n: t.to("cuda:0").contiguous() for n, t in s.items()} for r, s in cpu_shards.items()}
    job = f"guard-streamed-{quantization}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-{r[0]}", quantization=quantization) for r, s in shards.items()]
    on_current = torch.cuda.memory_allocated(0)
    share = sum(t.numel() * t.element_size() for t in hf.values())  # bf16
    receiver = RefitReceiver(rdzv, name=f"{job}-recv", timeout=30, device="cuda:1", memory_budget=int(0.6 * share))
    for version in (1, 2):
        for p in pubs:
            p.publish(version)
        got: dict[str, torch.Tensor] = {}

        def install(weights):
            for name, t in weights:
                assert t.device == OTHER, name
                got[name] = t.cpu()

        receiver.refit(install, version)
        assert receiver.stats.groups > 1 and torch.cuda.current_device() == 0
        assert got.keys() == want.keys()
        for k, t in got.items():
            assert torch.equal(t.view(torch.uint8), want[k].view(torch.uint8)), k
    assert torch.cuda.memory_allocated(0) == on_current
    receiver.close()
