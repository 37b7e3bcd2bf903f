"""Shared by the vLLM end-to-end tests: greedy generation in vLLM and in HF transformers
(token ids + chosen-token logprobs), and their comparison."""

from __future__ import annotations

import torch

PROMPTS = [[5, 17, 200, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 8
EXT = "megarefit.integrations.vllm.MegarefitWorkerExtension"


def vllm_generate(llm) -> list[tuple[list[int], list[float]]]:
    import vllm

    params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


@torch.no_grad()
def hf_generate(model) -> list[tuple[list[int], list[float]]]:
    result = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        tokens, logprobs = [], []
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids).logits[0, -1].float()
            t = int(logits.argmax())
            tokens.append(t)
            logprobs.append(float(torch.log_softmax(logits, -1)[t]))
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
        result.append((tokens, logprobs))
    return result


def same_generation(a, b, tol: float = 1e-3) -> bool:
    """Equal token ids and chosen-token logprobs within ``tol``."""
    return all(at == bt and max(abs(x - y) for x, y in zip(al, bl)) < tol
               for (at, al), (bt, bl) in zip(a, b, strict=True))
