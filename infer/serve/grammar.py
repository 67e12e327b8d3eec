"""Structured output: an OpenAI `response_format` (a JSON schema, any JSON object) or a regex or
Lark grammar -> a per-request constraint on the engine's tokens, through llguidance.

llguidance (Microsoft's Rust grammar engine behind Guidance) computes the allowed next tokens as
an int32 bitmask in tens of microseconds from a tiktoken encoding, with no torch dependency;
XGrammar and Outlines need torch or a HF tokenizer object. The engine applies the bitmask on the
device inside its step (`Engine.submit(allowed=...)`), so a constrained row shares the batch.
"""

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from zoo.tokenizer import Tokenizer

# Compact JSON unless the schema's "x-guidance" asks otherwise: with flexible whitespace a
# weak model can pad with blanks until its budget runs out.
JSON_DEFAULTS = {"whitespace_flexible": False}


class Constraint:
    """One request's grammar state: `allowed()` the bitmask of its next token, `consume` the
    tokens it got (called on the engine's thread, in order, before the next `allowed`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> np.ndarray:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
        self._check()
        return self.bitmask[0]

    def consume(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_stopped():  # complete: what follows is the end token it allowed
                return
            self.matcher.consume_token(token)
            self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"the output grammar failed: {self.matcher.get_error()}")


class Grammars:
    """The checkpoint's tokenizer as llguidance sees it (built once: about a second for a large
    vocabulary) and the grammars of requests. `end_ids` end a generation: the grammar allows
    them once its text is complete."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, end_ids: Iterable[int]):
        end_ids = list(end_ids)
        if not end_ids:
            raise ValueError(
                f"{tokenizer.source} names no end-of-sequence token, so a constrained output "
                "could never end; structured output needs one (eos_token in its config)"
            )
        self.vocab_size = vocab_size
        # llguidance reads the HF `tokenizers` JSON itself (what its own `hf.from_tokenizer`
        # passes it), special tokens included.
        backend = copy.copy(tokenizer.backend)
        backend.no_padding()
        backend.no_truncation()
        self.lltokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=end_ids
        )

    def grammar(
        self,
        response_format: Mapping[str, Any] | None,
        *,
        regex: str | None = None,
        lark: str | None = None,
    ) -> str | None:
        """The llguidance grammar of a request, or None when unconstrained. A schema or grammar
        llguidance refuses is a ValueError carrying its message."""
        kind = (response_format or {}).get("type", "text")
        chosen = [
            what
            for what, on in (("regex", regex), ("lark", lark), ("response_format", kind != "text"))
            if on
        ]
        if len(chosen) > 1:
            raise ValueError(f"give one output constraint, got {' and '.join(chosen)}")
        try:
            if regex is not None:
                grammar = llguidance.LLMatcher.grammar_from_regex(regex)
            elif lark is not None:
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            elif kind == "text":
                return None
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_DEFAULTS
                )
            elif kind == "json_schema":
                schema = (response_format.get("json_schema") or {}).get("schema")
                if not isinstance(schema, Mapping):
                    raise ValueError(
                        "response_format json_schema needs {'json_schema': {'name': ..., "
                        "'schema': {...}}}"
                    )
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults=JSON_DEFAULTS
                )
            else:
                raise ValueError(
                    f"response_format type {kind!r} is not one of text, json_object, json_schema"
                )
        except ValueError as error:
            raise ValueError(f"the output constraint was refused: {error}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.lltokenizer
        )
        if failed:
            raise ValueError(f"the output constraint was refused: {messages[0]}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher of `grammar` (one per generated choice)."""
        return Constraint(llguidance.LLMatcher(self.lltokenizer, grammar), self.vocab_size)
