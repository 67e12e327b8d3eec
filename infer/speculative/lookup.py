"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; the n-gram proposer of vLLM and
HF's `prompt_lookup_num_tokens`): the drafts are what followed the latest earlier occurrence of
the row's last n tokens in its own prompt and output. Free to propose (no model), strong when the
output copies from the input (rewriting, extraction, code edits), useless on free text."""

import equinox as eqx
import numpy as np
from jaxtyping import Int

from infer.speculative.proposer import Proposer, check_k


def _check(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"PromptLookup {name} must be an int >= {low}, got {value!r}")
    return int(value)


class PromptLookup(Proposer):
    """`k` drafts per step at most (the engine's static maximum; a request may ask for fewer),
    matched on the longest n-gram from `max_ngram` down to `min_ngram` tokens that occurred
    before. Runs on the host, on the tokens the request holds. `adaptive`: the engine verifies
    drafts only in steps where the rows' acceptance rates make it pay, and decodes one token
    per row otherwise (infer/speculative/adaptive.py); False verifies whenever a draft exists."""

    k: int = eqx.field(static=True, default=4)
    max_ngram: int = eqx.field(static=True, default=3)
    min_ngram: int = eqx.field(static=True, default=1)
    adaptive: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        check_k("PromptLookup", self.k)
        _check("min_ngram", self.min_ngram, 1)
        _check("max_ngram", self.max_ngram, self.min_ngram)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"PromptLookup adaptive must be True or False, got {self.adaptive!r}")

    def propose(self, tokens: Int[np.ndarray, " seq"], k: int) -> Int[np.ndarray, " drafts"]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        tail n-gram of `tokens` (empty when no n-gram recurs)."""
        tokens = np.asarray(tokens)
        for n in range(min(self.max_ngram, tokens.size - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero(np.all(windows == tokens[-n:], axis=1))
            if hits.size:
                start = hits[-1] + n
                return tokens[start : start + k]
        return tokens[:0]
