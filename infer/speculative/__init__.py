"""Speculative decoding in the serving engine: proposers of draft tokens and their verification
by one target forward per step (infer/engine.py runs it; verify.py accepts or rejects)."""

from infer.speculative.draft import DraftModel, check_tokenizers, truncated_draft
from infer.speculative.lookup import PromptLookup
from infer.speculative.proposer import Proposer
from infer.speculative.verify import accept_sampled, residual, verify

__all__ = [
    "DraftModel",
    "PromptLookup",
    "Proposer",
    "accept_sampled",
    "check_tokenizers",
    "residual",
    "truncated_draft",
    "verify",
]
