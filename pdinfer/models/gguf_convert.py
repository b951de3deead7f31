"""Turn a GGUF file into a Hugging Face-style folder (config.json, model.safetensors, tokenizer).

Done once per file: the folder is cached (``PDINFER_CACHE_DIR``), and every later load reads the
float safetensors through mmap, which takes a second instead of transformers' ~30 s.

Matrices stored as Q4_0, Q4_1 or Q8_0 also keep their original blocks, in ``quantized/``
(``blocks.safetensors``: one uint8 tensor [rows, row bytes] per Hugging Face name, Q/K rows
un-permuted like the floats; ``types.json``: name -> GGUF type). CPU decode steps of a few
sequences read those instead of the floats (``layers/cpu_linear.py``): the same weights, in a
fifth to a quarter of the bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("pdinfer")

CONVERTER_VERSION = 2  # 2: the quantized/ folder

QUANTIZED_DIR = "quantized"
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the block formats the CPU kernels read

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def converted_folder(gguf_path: str | os.PathLike, cache_dir: str) -> Path:
    """Return the cached converted folder for ``gguf_path``, converting it first if needed."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    folder = Path(cache_dir) / f"{path.stem}-{key}"
    if (folder / "model.safetensors").exists():
        return folder
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    logger.info("converting %s to a float checkpoint in %s (once)", path.name, folder)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        _convert(path, tmp)
        try:
            os.rename(tmp, folder)  # atomic: a concurrent converter may have won the race
        except OSError:
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1f s", time.perf_counter() - start)
    return folder


def _convert(path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(str(path))
    meta = _metadata(reader)
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {list(_ARCHITECTURES)})")
    config = _hf_config(meta, arch, {t.name for t in reader.tensors})
    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, np.ndarray] = {}
    block_types: dict[str, str] = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        data = data.reshape([int(d) for d in reversed(t.shape.tolist())])
        name = _hf_name(t.name)
        raw = None
        if t.tensor_type.name in BLOCK_TYPES and data.ndim == 2:
            raw = np.asarray(t.data, dtype=np.uint8).reshape(len(data), -1)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            data = unpermute_qk(data, heads)
            raw = None if raw is None else unpermute_qk(raw, heads)
        tensors[name] = np.ascontiguousarray(data)
        if raw is not None:
            blocks[name] = np.ascontiguousarray(raw)
            block_types[name] = t.tensor_type.name
    save_file(tensors, str(out / "model.safetensors"))
    if blocks:
        (out / QUANTIZED_DIR).mkdir()
        save_file(blocks, str(out / QUANTIZED_DIR / "blocks.safetensors"))
        (out / QUANTIZED_DIR / "types.json").write_text(json.dumps(block_types, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(path, out, meta)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its converter permutes for rotate-pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "token_type", "merges", "scores")):
            continue  # large arrays, only the tokenizer converter needs them
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - unreadable optional fields are skipped
            continue
    return meta


def _hf_config(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    p = f"{arch}."
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "vocab_size": int(meta.get(p + "vocab_size") or 0) or None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(meta[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(
                meta.get(p + "rope.scaling.original_context_length", config["max_position_embeddings"])
            ),
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    return config


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def _save_tokenizer(path: Path, out: Path, meta: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
