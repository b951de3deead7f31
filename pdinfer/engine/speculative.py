"""Which engines speculate, with what drafter, and what is refused (docs/usage.md).

The drafter, the draft pool and the acceptance rule live in ``core/spec_decode.py`` (host
only). The scheduler reserves 1 + k K/V slots for a drafting sequence, the step builder samples
all its rows, the output processor accepts and rolls back; the worker runs the step as a
decode step in which a speculating sequence is 1 + k rows, one per position (``StepBuilder``).
"""

from __future__ import annotations

from typing import Any

import torch

from pdinfer.config import EngineArgs
from pdinfer.core.spec_decode import DraftPool, NgramDrafter


def build_draft_pool(args: EngineArgs, hf_config: dict[str, Any], model: Any, device: torch.device) -> DraftPool | None:
    """The draft pool of an engine (None: it does not speculate). Only roles that decode build
    one (``EngineType.drafts_tokens``): a PE never drafts, whatever its arguments say, so one
    set of flags serves both halves of a P/D pair."""
    method = args.speculative_method
    if method is None or not args.role.drafts_tokens:
        return None
    if method == "mtp":
        layers = int(hf_config.get("num_nextn_predict_layers") or 0)
        has = f"has {layers} MTP layer(s), which pdinfer cannot run yet" if layers else "has no MTP module"
        raise ValueError(
            f"speculative_method='mtp' needs a checkpoint with a multi-token-prediction (MTP) module that "
            f"pdinfer runs; this model ({hf_config.get('architectures', ['?'])[0]}) {has}, and no model "
            "pdinfer supports has one yet: use speculative_method='ngram'"
        )
    if device.type != "cpu":
        raise ValueError(
            "speculative decoding runs on the CPU only for now: the CUDA path (its decode attention "
            "metadata and CUDA graphs) does not verify 1 + k-token decode rows yet; drop "
            "speculative_method or use device='cpu'"
        )
    if getattr(model, "build_attention_metadata", None) is not None or getattr(model, "state_shape", None):
        raise ValueError(
            "speculative decoding supports models with the paged K/V cache only (the Llama and "
            "Qwen families): this model's own cache layout (MLA) or per-sequence state cannot roll "
            "back rejected drafts yet"
        )
    return DraftPool(NgramDrafter(), args.max_num_seqs, args.num_draft_tokens)
