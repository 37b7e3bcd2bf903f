"""The dense model draws the plan tests share: Llama / Qwen2 / Qwen3 configs with tp, pp, query
groups, head_dim, ffn, vocab, biases and tied embeddings drawn (hypothesis)."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def dense_config(draw, tp: int, pp: int) -> dict:
    """A dense HF config dict that tp and pp divide (query groups, ffn and layers multiples of them)."""
    groups = tp * draw(st.integers(1, 3))
    return {"architectures": [draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))],
            "hidden_size": draw(st.integers(1, 64)), "num_attention_heads": groups * draw(st.integers(1, 4)),
            "num_key_value_heads": groups, "head_dim": draw(st.integers(1, 16)),
            "intermediate_size": tp * draw(st.integers(1, 50)), "num_hidden_layers": pp * draw(st.integers(1, 3)),
            "vocab_size": draw(st.integers(1, 5000)), "tie_word_embeddings": draw(st.booleans()),
            "attention_bias": draw(st.booleans()), "mlp_bias": draw(st.booleans())}
