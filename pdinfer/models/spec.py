"""The architecture description every model file reads, built from a Hugging Face config."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("pdinfer")

# Hugging Face "architectures" entries we implement, and the family each belongs to.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class KVCacheSpec:
    """What the paged cache holds per token and layer: ``parts`` vectors of ``heads x dim``.

    Dense attention stores K and V (2 x kv_heads x head_dim); MLA stores one compressed vector,
    the latent (kv_lora_rank) and the rotated key (qk_rope_head_dim) side by side (1 x 1 x
    their sum). The cache tensor is ``[num_blocks, num_layers, parts, block_size, heads, dim]``
    either way, so block copies, hand-offs and the store move whatever a block holds.
    """

    num_layers: int
    parts: int
    heads: int
    dim: int

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, self.parts, block_size, self.heads, self.dim)

    def bytes_per_token(self, itemsize: int) -> int:
        return self.num_layers * self.parts * self.heads * self.dim * itemsize


@dataclass(frozen=True)
class MoESpec:
    """Sparse MoE layers: routing and expert shapes (Qwen3-MoE, DeepSeekMoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    sparse_layers: tuple[int, ...]  # the other layers have a dense MLP
    scoring: str = "softmax"  # "softmax" (Qwen3-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1
    num_groups: int = 1  # grouped top-k: experts come in groups, ...
    topk_groups: int = 1  # ... a token picks among the experts of its best groups only
    group_score: str = "max"  # a group's score: its best expert ("max", V2) or best two ("top2", V3)
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # DeepSeekMoE: experts every token goes through
    correction_bias: bool = False  # V3: e_score_correction_bias shifts the choice, not the weights


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary on (even, odd) pairs, as DeepSeek's checkpoints lay it out
    softmax_scale: float


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
    moe: MoESpec | None = None
    mla: MLASpec | None = None

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
        mla = _mla_spec(cfg, rope_scaling) if family.startswith("deepseek") else None
        if mla is not None:  # the query/key head; the config's head_dim is the rotary part
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
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
            qk_norm=family in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            moe=_moe_spec(cfg, family),
            mla=mla,
        )

    @property
    def kv_cache(self) -> KVCacheSpec:
        if self.mla is not None:
            return KVCacheSpec(self.num_layers, 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return KVCacheSpec(self.num_layers, 2, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the paged cache per token over all layers, for float32."""
        return self.kv_cache.bytes_per_token(4)


def _moe_spec(cfg: dict[str, Any], family: str) -> MoESpec | None:
    layers = range(cfg["num_hidden_layers"])
    if family == "qwen3_moe":
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in layers if num_experts > 0 and i not in dense and (i + 1) % step == 0)
        return MoESpec(
            num_experts=num_experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            sparse_layers=sparse,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    if not family.startswith("deepseek"):
        return None
    v3 = family == "deepseek_v3"
    # V2 groups only with topk_method "group_limited_greedy"; V3 always groups (n_group 1: no-op).
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    first_dense = cfg.get("first_k_dense_replace") or 0
    return MoESpec(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        sparse_layers=tuple(i for i in layers if i >= first_dense),
        scoring="sigmoid" if v3 else "softmax",
        # transformers' V2 never renormalizes (it drops the config's norm_topk_prob)
        norm_topk_prob=v3 and bool(cfg.get("norm_topk_prob", True)),
        num_groups=(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=(cfg.get("topk_group") or 1) if grouped else 1,
        group_score="top2" if v3 else "max",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        correction_bias=v3,
    )


def _mla_spec(cfg: dict[str, Any], rope: dict[str, Any]) -> MLASpec:
    nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rope_dim) ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):  # YaRN sharpens the softmax
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return MLASpec(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg["v_head_dim"],
        # V2's checkpoints are interleaved (transformers rotates them as complex pairs)
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
    )


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
