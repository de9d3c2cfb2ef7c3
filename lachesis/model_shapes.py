"""The shapes of the models people start agent RL with (the values of their config.json
files), to build random-weight models locally (no model hub): the GPU suite
(``benchmarks/gpu_suite.py``) measures them, and the tests check the example configs
against them (``tests/test_example_configs.py``).

Sources: the ``config.json`` of Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct and Qwen/Qwen3-4B.
"""

from __future__ import annotations

from typing import Any

# Qwen2.5 shapes (their config.json files), random weights.
_QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
)
QWEN25_SHAPES = {
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-1.5b": {**_QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12},
    "qwen2.5-3b": {**_QWEN25_05B, "hidden_size": 2048, "intermediate_size": 11008,
                   "num_hidden_layers": 36, "num_attention_heads": 16},
    "qwen2.5-7b": {**_QWEN25_05B, "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "tie_word_embeddings": False},
}
# Qwen3-4B's shape (q/k norms, head_dim 128 with hidden 2560), tied, random weights.
QWEN3_SHAPES = {
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
}
SHAPES: dict[str, dict[str, Any]] = {**QWEN25_SHAPES, **QWEN3_SHAPES}


def build_config(name: str):
    """The ``transformers`` config of shape ``name`` (a key of :data:`SHAPES`)."""
    from transformers import Qwen2Config, Qwen3Config

    return (Qwen3Config if name in QWEN3_SHAPES else Qwen2Config)(**SHAPES[name])
