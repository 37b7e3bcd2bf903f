"""Block-FP8 on a GPU (skipped without CUDA; run on a GPU machine).

The fused Triton quantizer (one launch for every block of every tensor) must give the
same bytes as the torch path on the CPU -- which tests/test_fp8.py proves bit-identical
to vLLM's ``per_block_cast_to_fp8`` -- for edge blocks, bf16 / fp16 / fp32 sources,
all-zero blocks, tiny and huge magnitudes and row-strided views; and an FP8 refit with
GPU trainers and a GPU receiver over NIXL must equal the CPU quantization of the HF
tensors. (Verified on an H200: see docs/benchmarks.md.)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from megarefit.quant import Fp8Format, quantize_fp8  # noqa: E402
from megarefit.quant.kernel import Fp8Quantizer  # noqa: E402


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu() if t.dtype == torch.float8_e4m3fn else t.cpu()


def test_fused_quantizer_matches_the_cpu_formula():
    g = torch.Generator().manual_seed(0)
    shapes = [(128, 128), (256, 384), (200, 130), (1, 5), (129, 257), (768, 2048), (3000, 7)]
    items, want = [], []
    for i, shape in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = (torch.randn(shape, generator=g) * [1e-6, 1.0, 300.0][i % 3]).to(dtype)
            w[: shape[0] // 4] = 0
            want.append(quantize_fp8(w, Fp8Format()))
            src = w.cuda()
            if i == 1:  # a row-strided view (stride(0) > columns), as a slice of a wider tensor
                wide = torch.zeros(shape[0], shape[1] + 64, dtype=dtype, device="cuda")
                wide[:, :shape[1]] = src
                src = wide[:, :shape[1]]
            out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
            scale = torch.empty(Fp8Format().scale_shape(shape), dtype=torch.float32, device="cuda")
            items.append((src, out, scale))
    quantizer = Fp8Quantizer(items, Fp8Format())
    assert quantizer.fused
    quantizer()
    torch.cuda.synchronize()
    for (_, out, scale), (q, s) in zip(items, want):
        assert torch.equal(_bytes(out), _bytes(q)) and torch.equal(scale.cpu(), s)
    # the torch path on the GPU agrees too (UE8M0 scales and machines without Triton take it)
    for (src, _, _), (q, s) in zip(items, want):
        gq, gs = quantize_fp8(src, Fp8Format())
        assert torch.equal(_bytes(gq), _bytes(q)) and torch.equal(gs.cpu(), s)


def test_fp8_refit_with_gpu_trainers_and_receiver(config):
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    import megarefit
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher
    from megarefit.quant import quantized_weight_names, scale_name

    cfg = config("Qwen3-0.6B", hidden_size=256, head_dim=64, num_attention_heads=4, intermediate_size=512)
    hf = reference_hf_state(cfg, "qwen3", dtype=torch.bfloat16)
    shards = reference_shards(hf, cfg, tp=2, pp=1)
    rdzv = Rendezvous.serve(job="fp8-gpu")
    pubs = [Publisher({n: t.cuda().contiguous() for n, t in s.items()}, cfg, rank=r,
                      layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv, agent_name=f"fp8-gpu-t{r[0]}",
                      quantization="fp8") for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    assert all(p._quantize.fused for p in pubs)
    got = dict(RefitReceiver(rdzv, name="fp8-gpu-recv", timeout=60, device="cuda:0").run_refit_cycle(1))
    quantized = quantized_weight_names(megarefit.ModelDims.from_hf_config(cfg))
    for name, w in hf.items():
        if name in quantized:
            q, s = quantize_fp8(w, Fp8Format())
            assert torch.equal(_bytes(got[name]), _bytes(q)) and torch.equal(got[scale_name(name)].cpu(), s), name
        else:
            assert torch.equal(got[name].cpu(), w), name
