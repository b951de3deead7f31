"""Hugging Face tensors into fused and stacked parameters, for the MoE model families.

A checkpoint names each expert's projections separately (``mlp.experts.3.gate_proj.weight``);
our layers stack the experts (``mlp.experts.gate_up_proj`` [E, 2 * I, H]) and fuse gate with up
(and, for plain attention, q with k and v). ``load_checkpoint`` writes each tensor into its
slice of the parameter and checks that every element of every parameter was written once.
Checkpoints already in transformers' stacked layout (``mlp.experts.gate_up_proj``) load as is.
With expert parallelism or redundant experts a layer holds slots, not experts
(``Experts.slot_experts``): an expert's tensors go into every local slot that names it, and into
none when another rank holds it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

# checkpoint projection -> (our fused parameter, its part)
GATE_UP = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
QKV = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: dict[str, tuple[str, str]],
    part_rows: dict[str, tuple[int, int]],
    num_layers: int,
) -> None:
    """Copy Hugging Face-named ``weights`` into ``model``'s parameters.

    ``fused`` maps checkpoint projections to (fused parameter, part); ``part_rows`` gives the
    row range of the parts that are not halves (q, k, v); gate and up are the two halves of
    their parameter's rows. Tensors of layers past ``num_layers`` (DeepSeek-V3's multi-token
    prediction layer) and rotary buffers are skipped; a tied ``lm_head`` ignores its tensor.
    """
    params = dict(model.named_parameters())
    written = dict.fromkeys(params, 0)
    slot_experts = _slot_experts(model)
    for name, tensor in weights:
        name = name.removeprefix("model.")
        layer = _LAYER.match(name)
        if "rotary_emb" in name or (layer is not None and int(layer.group(1)) >= num_layers):
            continue
        if name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
            continue
        target, located = _locate(name, fused, part_rows, params)
        for index, part in _into_slots(target, located, tensor, slot_experts):
            param = params[target]
            with torch.no_grad():
                dest = param if index is None else param[index]
                if dest.shape != part.shape:
                    raise ValueError(f"{name}: shape {tuple(part.shape)} != {tuple(dest.shape)}")
                dest.copy_(part)
            written[target] += dest.numel()
    missing = sorted(n for n, p in params.items() if written[n] != p.numel())
    if missing:
        raise ValueError(f"checkpoint is missing or repeats {len(missing)} tensors, e.g. {missing[:4]}")


def _slot_experts(model: nn.Module) -> dict[str, list[int]]:
    """Stacked expert parameter -> the logical expert of each of its slots (this rank's)."""
    from pdinfer.layers.moe import Experts

    slots = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            for param in ("gate_up_proj", "down_proj"):
                slots[f"{module_name}.{param}"] = module.slot_experts
    return slots


def _into_slots(target: str, index: tuple | None, tensor: torch.Tensor, slot_experts: dict[str, list[int]]):
    """(index, tensor) writes of one checkpoint tensor: an expert's into every local slot
    holding it (none when another rank holds it, several for replicas); a stacked tensor's
    rows picked for the local slots."""
    slots = slot_experts.get(target)
    if slots is None:
        return [(index, tensor)]
    if index is None:  # transformers' stacked layout: [E, ...]
        return [(None, tensor.index_select(0, torch.tensor(slots, dtype=torch.int64)))]
    expert, rest = index[0], index[1:]
    return [((slot, *rest), tensor) for slot, e in enumerate(slots) if e == expert]


def _locate(name: str, fused, part_rows, params) -> tuple[str, tuple | None]:
    """(our parameter, the index of this tensor's slice in it; None: all of it)."""
    expert = None
    if (m := _EXPERT.search(name)) is not None:  # one expert of a stacked set
        expert = int(m.group(1))
        # experts.3.down_proj.weight -> experts.down_proj, row 3
        name = (name[: m.start()] + ".experts." + name[m.end() :]).removesuffix(".weight")
    part = None
    pieces = name.split(".")
    for i, piece in enumerate(pieces):
        if piece in fused:
            pieces[i], part = fused[piece]
            break
    target = ".".join(pieces)
    if target not in params:
        raise ValueError(f"checkpoint tensor {name} has no place in this model")
    index: tuple = () if expert is None else (expert,)
    if part is not None:
        rows = params[target].shape[len(index)]
        start, end = part_rows.get(part) or ((0, rows // 2) if part == "gate" else (rows // 2, rows))
        index += (slice(start, end),)
    return target, (index or None)
