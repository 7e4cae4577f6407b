"""Model shapes the simulator can cost, from each model's public Hugging Face ``config.json``.

Only the shape matters to the cost model (layers, widths, heads, vocabulary, whether the LM head
is tied); the token ids and norm epsilons are carried for completeness and are not used by the
simulator. ``smollm2-135m`` is the model the engine ships and loads from its GGUF file; a test
checks the two shapes agree.

Published sizes ``num_params()`` reproduces (within 2%): Llama-2 7B 6.74e9 / 13B 13.0e9,
Llama-3 8B 8.03e9 / 70B 70.6e9, OPT-13B 12.9e9, Qwen2.5 14B 14.7e9 / 32B 32.8e9 / 72B 72.7e9,
SmolLM2-135M 134.5e6. OPT differs from the Llama family in ways the shape records only in part:
a plain two-matrix MLP (``mlp_matrices=2``, fc1/fc2 with ffn_dim 20480), full multi-head
attention, biases on every projection (only the QKV ones are counted), LayerNorm and learned
position embeddings (2050 x hidden, ~10M parameters, not counted).
"""

from __future__ import annotations

from dataclasses import replace

from tidal.config import ModelArch


def _llama2(name: str, hidden: int, inter: int, layers: int, heads: int) -> ModelArch:
    return ModelArch(architecture="llama", vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), name=name)


def _llama3(name: str, hidden: int, inter: int, layers: int, heads: int) -> ModelArch:
    return ModelArch(architecture="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                     rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                     bos_token_id=128000, eos_token_ids=(128001,), name=name)


def _qwen25(name: str, hidden: int, inter: int, layers: int, heads: int, eps: float) -> ModelArch:
    return ModelArch(architecture="qwen2", vocab_size=152064, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128, rms_norm_eps=eps,
                     rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                     attention_bias=True, bos_token_id=151643, eos_token_ids=(151643,), name=name)


MODELS: dict[str, ModelArch] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct)
    "smollm2-135m": ModelArch(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        name="smollm2-135m"),
    # meta-llama/Llama-2-7b-hf, Llama-2-13b-hf
    "llama-2-7b": _llama2("llama-2-7b", 4096, 11008, 32, 32),
    "llama-2-13b": _llama2("llama-2-13b", 5120, 13824, 40, 40),
    "llama-65b": replace(_llama2("llama-65b", 8192, 22016, 80, 64), max_position_embeddings=2048),  # LLaMA-1 65B (MHA)
    # meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B
    "llama-3-8b": _llama3("llama-3-8b", 4096, 14336, 32, 32),
    "llama-3-70b": _llama3("llama-3-70b", 8192, 28672, 80, 64),
    # facebook/opt-13b: ffn_dim 20480, MHA, tied LM head (OPTForCausalLM ties it to embed_tokens)
    "opt-13b": ModelArch(
        architecture="opt", vocab_size=50272, hidden_size=5120, intermediate_size=20480, num_layers=40,
        num_heads=40, num_kv_heads=40, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True,
        attention_bias=True, mlp_matrices=2, bos_token_id=2, eos_token_ids=(2,), name="opt-13b"),
    # Qwen/Qwen2.5-14B, Qwen2.5-32B, Qwen2.5-72B (max_position_embeddings: the 32768 native window)
    "qwen-2.5-14b": _qwen25("qwen-2.5-14b", 5120, 13824, 48, 40, 1e-5),
    "qwen-2.5-32b": _qwen25("qwen-2.5-32b", 5120, 27648, 64, 40, 1e-5),
    "qwen-2.5-72b": _qwen25("qwen-2.5-72b", 8192, 29568, 80, 64, 1e-6),
}


def get_model(name: str) -> ModelArch:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}") from None


__all__ = ["MODELS", "get_model"]
