"""The architecture description every model file reads, built from a Hugging Face config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("pdinfer")

# Hugging Face "architectures" entries we implement, and the family each belongs to.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; pdinfer supports "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_scaling = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            family=family,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_scaling.pop("rope_theta")),
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_context(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, for float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _max_context(cfg: dict[str, Any]) -> int:
    """The model's context, capped at its sliding window: attention here is always full, which
    equals sliding-window attention only while a sequence fits in the window."""
    max_len = cfg.get("max_position_embeddings", 2048)
    window = _sliding_window(cfg)
    if window is not None and window < max_len:
        logger.warning(
            "sliding-window attention is not implemented: context capped at the "
            "window, %d tokens (the model allows %d)",
            window,
            max_len,
        )
        return window
    return max_len


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window of any layer, as transformers applies it, or None."""
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:  # Qwen keeps a value it ignores
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if "max_window_layers" in cfg and cfg["max_window_layers"] >= cfg["num_hidden_layers"]:
        return None  # Qwen2: only layers from max_window_layers on slide
    return window


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in one dict, whether the config uses the 4.x or the 5.x spelling."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("yarn", "llama3") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    params["rope_type"] = rope_type
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return params
