"""The DPO example's documented behaviour as a checker for `python -m training.evaluate`
(`--checker examples/brevity.py:brief`): the assistant answers in one short sentence."""

from collections.abc import Mapping
from typing import Any

MAX_WORDS = 20


def brief(completion: str, row: Mapping[str, Any]) -> bool:
    """At most `MAX_WORDS` words (a reply cut off at --max-new-tokens 40 is longer than that)."""
    return 0 < len(completion.split()) <= MAX_WORDS
