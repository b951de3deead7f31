"""Structured outputs: a request's output must match a JSON schema, a regex, a list of choices or
an EBNF grammar (``SamplingParams.structured_outputs``, vLLM's kinds and names).

The grammar engine is xgrammar (Apache-2.0; the default of vLLM and SGLang). It was chosen over
llguidance and outlines-core because it runs the same on CPU and GPU hosts (the mask is computed
on the host, in C++, fast enough for a decode step: docs/performance.md), compiles a JSON
schema in milliseconds, and needs nothing from us but the tokenizer. Its token masks are bit
sets, one bit per vocabulary entry; ``Sampler`` applies them with plain torch on the logits'
device.

- ``GrammarCompiler`` compiles (cached per spec) and refuses an invalid schema, regex or grammar
  with a ``ValueError`` naming the problem: the request is a 400 at admission.
- Each sequence has its own ``Grammar`` (a matcher): the step builder asks it for the next
  token's mask, the output processor feeds it the sampled token, and a sequence whose grammar
  has ended (the match is complete and a stop token was taken) is finished.

A mask needs the previous token accepted. With zero-overhead scheduling the next step is
launched before the step in flight is post-processed, so its masks are deferred
(``DeferredMasks``): the forward runs while the host post-processes the step in flight (which
feeds the grammars) and then computes the masks; the runner waits for them just before sampling.
Where the engine cannot promise that order (a KV store, EPLB, a DP group or a PROMPT engine,
whose steps may be waited for between launch and post-processing) such a step first finishes the
step in flight instead (``LLMEngine.step_deltas``).
"""

from __future__ import annotations

import json
import threading

import torch

_CACHE_SIZE = 256
_MAX_WHITESPACE = 2  # characters of whitespace at most between two JSON tokens


class Grammar:
    """One sequence's matcher."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self._compiled = compiled
        self._vocab_size = vocab_size
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fresh(self) -> Grammar:
        """A matcher at the start of the same grammar (an n > 1 fork right after its prompt)."""
        return Grammar(self._compiled, self._vocab_size)

    def next_mask(self) -> torch.Tensor | None:
        """The allowed next tokens as int32 words of 32 bits, or None once the grammar ended."""
        import xgrammar

        if self._matcher.is_terminated():
            return None
        mask = xgrammar.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask)
        return mask[0]

    def accept(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def ended(self) -> bool:
        return bool(self._matcher.is_terminated())


class DeferredMasks:
    """The grammar masks of a step launched while the step before it is in flight.

    ``settle`` (an engine thread: the host work overlapped with the forward, or inline when the
    step must run before that) post-processes the step in flight once and then computes the
    masks; ``fill`` (the runner, just before sampling) waits for them and puts them into the
    samples. A failure of ``settle`` reaches both."""

    def __init__(self, settle_previous, grammars: dict[int, Grammar], wait_s: float = 600.0):
        self._settle_previous = settle_previous  # () -> the deltas of the step in flight
        self._grammars = grammars  # sample index -> its sequence's grammar
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._masks: dict[int, torch.Tensor | None] = {}
        self._deltas: list = []
        self._error: BaseException | None = None

    def settle(self) -> None:
        with self._lock:
            if not self._ready.is_set():
                try:
                    self._deltas = self._settle_previous()
                    self._masks = {i: g.next_mask() for i, g in self._grammars.items()}
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._ready.set()
        if self._error is not None:
            raise self._error

    def take_deltas(self) -> list:
        """The step in flight's deltas, once (after ``settle``)."""
        self.settle()
        deltas, self._deltas = self._deltas, []
        return deltas

    def fill(self, samples) -> None:
        if not self._ready.wait(self._wait_s):
            raise RuntimeError(f"the grammar masks of a step were not ready after {self._wait_s:g} s")
        if self._error is not None:
            raise RuntimeError("the host work that computes this step's grammar masks failed") from self._error
        for i, mask in self._masks.items():
            samples[i].allowed = mask  # None: the grammar ended, the row's token is discarded


class GrammarCompiler:
    """Compiles ``structured_outputs`` specs for one tokenizer (built at the first request)."""

    def __init__(self, tokenizer, vocab_size: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        self._cache: dict[str, object] = {}
        self._lock = threading.Lock()

    def grammar(self, spec: dict) -> Grammar:
        return Grammar(self.compile(spec), self.vocab_size)

    def compile(self, spec: dict):
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(spec)
                if len(self._cache) >= _CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = compiled
        return compiled

    def _compile(self, spec: dict):
        (kind,) = [k for k in spec if spec[k] not in (None, False)]  # SamplingParams checked it
        value = spec[kind]
        try:
            if kind in ("json", "json_object"):
                schema = value if isinstance(value, str) else json.dumps(value)
                if kind == "json_object":
                    schema = '{"type": "object"}'
                unenforced = unenforced_keyword(json.loads(schema))
                if unenforced is not None:
                    raise ValueError(f"the grammar engine cannot enforce {unenforced}")
                # Whitespace between tokens is bounded: a small model can otherwise emit
                # newlines until max_tokens (vLLM offers the same as disable_any_whitespace).
                return self._compiler.compile_json_schema(
                    schema, strict_mode=True, any_whitespace=True, max_whitespace_cnt=_MAX_WHITESPACE
                )
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(_regex_literal(c) for c in value))
            return self._compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(exc)}") from None


# What xgrammar (0.2) compiles but does not enforce: the output may break it. Such a schema is
# refused (a 400), never answered with JSON that ignores part of it. Measured against xgrammar's
# matcher with one breaking instance per keyword (the list in test_structured.py).
_UNENFORCED = (
    *("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies"),
    *("contains", "minContains", "maxContains"),
)
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri"}
_FORMATS |= {"uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_FORMATS |= {"password", "binary"}  # hints that any string meets (pydantic's SecretStr, bytes)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = (
    *("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems"),
    "propertyNames",
)


def unenforced_keyword(schema) -> str | None:
    """The first keyword of a JSON schema that the grammar engine would not enforce, with where it
    is (a JSON pointer); None if it enforces all of it."""
    return _Walk(schema).first(schema, "")


class _Walk:
    def __init__(self, root):
        self.root = root

    def first(self, schema, where: str) -> str | None:
        if not isinstance(schema, dict):
            return None
        at = f" (at {where or '/'})"
        for keyword in _UNENFORCED:
            if keyword in schema:
                return f"{keyword!r}{at}"
        if schema.get("uniqueItems") is True:
            return f"'uniqueItems'{at}"
        if len(schema.get("allOf") or ()) > 1:
            return f"'allOf' of several schemas{at}: merge them into one"
        if isinstance(schema.get("format"), str) and schema["format"] not in _FORMATS:
            return f"format {schema['format']!r}{at}"
        one_of = [self.resolve(s) for s in schema.get("oneOf") or ()]
        if any(not self.apart(a, b) for i, a in enumerate(one_of) for b in one_of[i + 1 :]):
            return f"'oneOf' whose schemas may overlap{at}: use anyOf, or tell them apart by type or by a const"
        subschemas = [(f"{where}/{k}", schema.get(k)) for k in _SCHEMAS]
        for k in _SCHEMA_LISTS:  # a stranger's schema: a list or map may be anything
            listed = schema.get(k)
            subschemas += [(f"{where}/{k}/{i}", s) for i, s in enumerate(listed if isinstance(listed, list) else [])]
        for k in _SCHEMA_MAPS:
            named = schema.get(k)
            subschemas += [(f"{where}/{k}/{n}", s) for n, s in (named.items() if isinstance(named, dict) else [])]
        return next(filter(None, (self.first(sub, path) for path, sub in subschemas)), None)

    def resolve(self, schema):
        """A local ``$ref`` (``#/$defs/Cat``) followed; anything else as it is."""
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/")):
            return schema
        node = self.root
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        return node

    def apart(self, a, b) -> bool:
        """oneOf's schemas are enforced as anyOf's: exact when no value matches two of them. Two
        schemas are told apart here by their types, their consts, or the const of a property both
        require (a discriminated union)."""
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        types_a, types_b = _types(a), _types(b)
        if types_a is not None and types_b is not None and not types_a & types_b:
            return True
        if None not in (_const(a), _const(b)) and _const(a) != _const(b):
            return True
        for name in set(a.get("required") or ()) & set(b.get("required") or ()):
            consts = [_const(self.resolve((s.get("properties") or {}).get(name))) for s in (a, b)]
            if None not in consts and consts[0] != consts[1]:
                return True
        return False


def _types(schema: dict) -> set | None:
    """A schema's types, an integer counted as a number; None if it names none."""
    named = schema.get("type")
    if named is None:
        return None
    types = set(named if isinstance(named, list) else [named])
    return types | {"integer"} if "number" in types else types


def _const(schema) -> str | None:
    """A schema's one allowed value (``const``, or an enum of one), as JSON."""
    if isinstance(schema, dict):
        if "const" in schema:
            return json.dumps(schema["const"], sort_keys=True)
        if isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1:
            return json.dumps(schema["enum"][0], sort_keys=True)
    return None


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip():
            # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message
            return line.split(": ", 1)[-1] if line.startswith("[") else line
    return type(exc).__name__
