"""Speculative decoding in the serving engine: proposers of draft tokens and their verification
by one target forward per step (infer/engine.py runs it; verify.py accepts or rejects)."""

from infer.speculative.lookup import PromptLookup
from infer.speculative.proposer import Proposer
from infer.speculative.verify import accept_sampled, residual, verify

__all__ = ["PromptLookup", "Proposer", "accept_sampled", "residual", "verify"]
