"""Built-in model configs (real shapes) for ``--load-format dummy`` where no folder exists."""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "eos_token_id": 128001,
        "bos_token_id": 128000,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "eos_token_id": 128001,
        "bos_token_id": 128000,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
}
