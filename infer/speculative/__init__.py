"""Speculative decoding in the serving engine: proposers of draft tokens and their verification
by one target forward per step (infer/engine.py runs it; verify.py accepts or rejects; adaptive.py
decides per step whether verifying pays, and how many drafts)."""

from infer.speculative.draft import DraftModel, check_tokenizers, draft_vocab, truncated_draft
from infer.speculative.lookup import PromptLookup
from infer.speculative.mtp import MTPDraft
from infer.speculative.proposer import Proposer
from infer.speculative.verify import accept_sampled, residual, verify

__all__ = [
    "DraftModel",
    "MTPDraft",
    "PromptLookup",
    "Proposer",
    "accept_sampled",
    "check_tokenizers",
    "draft_vocab",
    "residual",
    "truncated_draft",
    "verify",
]
