"""Shared by the vLLM end-to-end tests: greedy generation in vLLM and in HF transformers
(token ids + chosen-token logprobs), and their comparison."""

from __future__ import annotations

import torch

PROMPTS = [[5, 17, 200, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]
MAX_TOKENS = 8
EXT = "megarefit.integrations.vllm.MegarefitWorkerExtension"


def vllm_generate(llm, prompts=PROMPTS, lora_request=None) -> list[tuple[list[int], list[float]]]:
    import vllm

    params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, detokenize=False,
                                 ignore_eos=True)  # HF's loop below never stops early either
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora_request)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def generate_or_refusal(llm, key: str) -> dict:
    """``{key: vllm_generate(llm)}``, or ``{"refused": error}`` where the engine refuses to run
    (a model holding a mix of versions raises, and the engine stops)."""
    try:
        return {key: vllm_generate(llm)}
    except Exception as exc:  # noqa: BLE001 - the engine refuses (and stops): nothing is served
        return {"refused": f"{type(exc).__name__}: {exc}"}


@torch.no_grad()
def hf_generate(model, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    result = []
    for p in prompts:
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


# What the logprob-parity check feeds through a real tokenizer (text, not token ids).
PROMPT_TEXT = ("The trainer publishes a new version of the weights; every vLLM worker pulls its own shard "
               "and the next rollout samples from the model that was just trained.")


def bpe_tokenizer(directory, vocab_size: int):
    """A real byte-level BPE tokenizer (HF ``tokenizers``, trained here on this repository's
    README so the tests need no download) with ``vocab_size`` entries, saved to
    ``directory`` as ``tokenizer.json`` + ``tokenizer_config.json``; returns it as a
    ``PreTrainedTokenizerFast``."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines() + [PROMPT_TEXT], trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return fast


def vllm_prompt_logprobs(llm, text: str, vocab: int) -> tuple[list[int], torch.Tensor]:
    """vLLM's prompt logprobs of ``text`` (tokenized by the engine's tokenizer): the prompt's
    token ids and ``[len - 1, vocab]`` fp64 log-probabilities of every vocabulary entry at
    each position after the first (row i: the distribution of token i + 1)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
    (out,) = llm.generate([text], params, use_tqdm=False)
    rows = []
    for entry in out.prompt_logprobs[1:]:
        row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        for token, lp in entry.items():
            if token < vocab:
                row[token] = lp.logprob
        rows.append(row)
    return list(out.prompt_token_ids), torch.stack(rows)


def e2e_config() -> dict:
    """The tiny Qwen3-architecture config the vLLM end-to-end tests serve (vocab 500, tied)."""
    from conftest import tiny_config

    return tiny_config("Qwen3-0.6B", vocab_size=500, hidden_size=128, intermediate_size=256, head_dim=64)


def initial_checkpoint(directory, cfg: dict):
    """An HF checkpoint of random weights (seed 0) with :func:`bpe_tokenizer`'s tokenizer in
    ``directory``, what a vLLM engine starts from before its first refit; returns
    ``(tokenizer, the HF model)``."""
    from megarefit.integrations.hf import build_hf_model, save_checkpoint

    tokenizer = bpe_tokenizer(directory, cfg["vocab_size"])
    torch.manual_seed(0)
    model = build_hf_model(cfg)
    save_checkpoint(directory, cfg, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return tokenizer, model


def completions(base: str, model: str) -> list[tuple[list[int], list[float]]]:
    """Greedy ``/v1/completions`` of every prompt of a vLLM server at ``base`` (token ids in,
    token ids and logprobs out)."""
    import json
    import urllib.request

    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def wait_healthy(base: str, server, log, timeout: float = 300.0) -> None:
    """Until the vLLM server at ``base`` answers ``/health`` (``server``: its Popen, ``log``: its
    output file, shown when it exits first)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise AssertionError("vLLM server exited:\n" + log.read()[-4000:])
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"vLLM server not healthy after {timeout} s")


def stop_server(server) -> None:
    """Terminate the server, killing it if it has not exited after 60 s."""
    import subprocess

    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
