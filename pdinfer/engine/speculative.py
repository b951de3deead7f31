"""Which engines speculate, with what drafter (n-gram, or DeepSeek-V3's MTP layer:
``worker/mtp_drafter.py``), and what is refused (docs/usage.md).

The drafter, the draft pool and the acceptance rule live in ``core/spec_decode.py`` (host
only). The scheduler reserves 1 + k K/V slots for a drafting sequence, the step builder samples
all its rows, the output processor accepts and rolls back; the worker runs the step as a
decode step in which a speculating sequence is 1 + k rows, one per position (``StepBuilder``).

On CUDA that step is a plain decode step too: the Triton kernels write every row's K/V before
any row attends (an engine that verifies drafts does not fold the KV write into the decode
attention: ``RunnerOptions.verifies_drafts``), each row carries its own context length, and the
decode CUDA graphs are captured up to the largest verifying step's rows (``decode_graph_rows``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdinfer.config import EngineArgs
from pdinfer.core.spec_decode import Drafter, DraftPool, NgramDrafter, max_verify_rows

if TYPE_CHECKING:
    from pdinfer.engine.step_builder import InFlight
    from pdinfer.worker.runner import StepRunner
    from pdinfer.worker.step_input import StepResult


def build_draft_pool(
    args: EngineArgs, hf_config: dict[str, Any], runner: StepRunner, num_blocks: int, block_size: int
) -> DraftPool | None:
    """The draft pool of an engine (None: it does not speculate). Only roles that decode build
    one (``EngineType.drafts_tokens``): a PE never drafts, whatever its arguments say, so one
    set of flags serves both halves of a P/D pair."""
    method = args.speculative_method
    if method is None or not args.role.drafts_tokens:
        return None
    if getattr(runner.model, "state_shape", None):
        raise ValueError(
            "speculative decoding supports models with a paged K/V cache only (Llama, Qwen and "
            "DeepSeek families): a per-sequence state cannot roll back rejected drafts yet"
        )
    if method == "mtp":
        drafter: Drafter = _mtp_drafter(args, hf_config, runner, num_blocks, block_size)
        runner.keep_hidden = True  # the MTP layer reads every row's hidden state
    else:
        drafter = NgramDrafter()
    return DraftPool(drafter, args.max_num_seqs, args.num_draft_tokens)


def decode_graph_rows(args: EngineArgs) -> int:
    """Rows the decode CUDA graphs cover: ``max_num_seqs``, or the largest verifying step where
    the engine drafts (``max_verify_rows``: 16 sequences x (1 + k) rows at most, since larger
    batches do not draft). ``CudaGraphRunner`` caps this at its largest bucket (256 rows): a
    larger step is bound by its GEMMs' arithmetic, and the host's launch time that a graph saves
    is a small part of it."""
    rows = args.max_num_seqs
    if args.speculative_method is not None and args.role.drafts_tokens:
        rows = max(rows, max_verify_rows(args.max_num_seqs, args.num_draft_tokens))
    return rows


def mtp_cache_layers(args: EngineArgs) -> int:
    """Cache layers the engine's drafter adds per block: the MTP layer's latent cache, where
    an engine drafts with it (counted when the KV memory is divided into blocks)."""
    return int(args.speculative_method == "mtp" and args.role.drafts_tokens)


def _mtp_drafter(
    args: EngineArgs, hf_config: dict[str, Any], runner: StepRunner, num_blocks: int, block_size: int
) -> Drafter:
    layers = int(hf_config.get("num_nextn_predict_layers") or 0)
    spec = runner.spec
    if not layers or spec.mla is None or spec.moe is None:
        has = f"has {layers} MTP layer(s) but is not a DeepSeek-V3 model" if layers else "has no MTP module"
        raise ValueError(
            "speculative_method='mtp' needs a DeepSeek-V3 checkpoint with a multi-token-prediction "
            f"module (num_nextn_predict_layers >= 1); this model ({spec.architecture}) {has}: use "
            "speculative_method='ngram'"
        )
    if runner.moe_layers:
        raise ValueError("speculative_method='mtp' does not run with expert parallelism or redundant experts yet")
    from pdinfer.models.decoder import DecoderLM
    from pdinfer.models.deepseek_mtp import build_mtp
    from pdinfer.worker.mtp_drafter import MTPDrafter

    if not isinstance(runner.model, DecoderLM):  # the checks above admit DeepSeek only
        raise TypeError(f"an MTP layer drafts for a DeepSeek model, not {type(runner.model).__name__}")
    mtp = build_mtp(spec, runner.folder, args.load_format, runner.dtype, runner.device, args.seed)
    return MTPDrafter(mtp, runner.model, num_blocks, block_size, args.num_draft_tokens)


def observe_hidden(pool: DraftPool, inflight: InFlight, result: StepResult) -> None:
    """Hand a processed step's hidden states to a hidden-state drafter: for each sequence the
    rows of its positions whose next token is now known (accepted drafts and the bonus token
    included; rejected drafts' rows dropped)."""
    inp, hidden = inflight.inp, result.hidden
    row = 0
    for seq, num_tokens in zip(inflight.plan.scheduled_seqs, inflight.plan.num_scheduled_tokens):
        first = inp.positions[row]
        known = min(num_tokens, len(seq.token_ids) - 1 - first)  # position p needs token p + 1
        if known > 0 and not seq.is_finished:
            pool.observe(seq, first, hidden[row : row + known])
        row += num_tokens
