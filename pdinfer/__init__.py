"""pdinfer: one engine class that plays NORMAL, PROMPT and COMPLETION, with a working P/D hand-off."""

import logging as _logging

from pdinfer import env as _env
from pdinfer.config import EngineArgs
from pdinfer.engine.llm import LLM
from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.engine_type import EngineType
from pdinfer.outputs import CompletionOutput, RequestOutput
from pdinfer.sampling_params import SamplingParams

_logger = _logging.getLogger("pdinfer")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_env.get("PDINFER_LOG_LEVEL").upper())
    _logger.propagate = False

__all__ = [
    "LLM", "SamplingParams", "EngineArgs", "EngineType", "LLMEngine",
    "RequestOutput", "CompletionOutput",
]
__version__ = "0.1.0"
