"""tests/test_vllm_lora.py's two adapter versions with vLLM's workers in other processes, run by
hand (a second engine costs a minute or more on 2 cores, past the suite's budget)::

    python tests/vllm_lora_scenario.py            # engine core in its own process
    VLLM_CPU_OMP_THREADS_BIND="0|1" python tests/vllm_lora_scenario.py --tp 2   # + 2 TP workers

Prints whether vLLM's greedy generation equals transformers + peft for each version, and the
refusal of an unserved module as it comes back from the worker processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import test_vllm_lora as t
    import torch
    from vllm_helpers import hf_generate, same_generation, vllm_generate

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size (worker processes)")
    tp = parser.parse_args().tp
    ckpt = tempfile.mkdtemp()
    _, _, adapters = t.base_and_adapters(ckpt)
    llm = t.vllm.LLM(model=ckpt, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                     block_size=32, max_num_seqs=4, enable_lora=True, max_lora_rank=8, max_loras=1,
                     worker_extension_cls=t.EXT, tensor_parallel_size=tp,
                     distributed_executor_backend="mp" if tp > 1 else None)
    print("engine client:", type(llm.llm_engine.engine_core).__name__, "tp:", tp)
    for version, (model, tensors) in enumerate(adapters, start=1):
        request = t.install_lora(llm, t.NAME, tensors, t.CONFIG, version=version)
        print(f"version {version} generates as peft:", same_generation(vllm_generate(llm, t.ALL, request),
                                                                        hf_generate(model, t.ALL)))
    bad = dict(adapters[1][1])
    bad["base_model.model.model.layers.1.self_attn.q_norm.lora_A.weight"] = torch.ones(8, 64)
    bad["base_model.model.model.layers.1.self_attn.q_norm.lora_B.weight"] = torch.ones(64, 8)
    try:
        t.install_lora(llm, t.NAME, bad, {**t.CONFIG, "target_modules": [*t.TARGETS, "q_norm"]}, version=3)
    except Exception as exc:  # noqa: BLE001 - printed: the worker's refusal, as the RPC layer returns it
        print("refused:", type(exc).__name__, str(exc)[:240])


if __name__ == "__main__":
    main()
