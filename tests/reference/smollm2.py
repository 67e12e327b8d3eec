"""The SmolLM2 reference numbers (transformers on the GGUF), computed once per test session.

Tests that use `smollm2_reference` carry `pytest.mark.xdist_group("smollm2")`, so that with
`pytest -n 2 --dist loadgroup` one worker runs them all and the reference job runs once.
"""

import json

import numpy as np
import pytest

from tests.reference.runner import run_reference, smollm2_gguf

PROMPT = "The capital of France is"
NEW_TOKENS = 8
TEXTS = [
    "Hello world! Numbers 12345, 3.14159 and 2024-11-21; x  1  22\tend.",
    "Accents: café, naïve, Ünïcödé, señor, Øresund. CJK: 東京は日本の首都です。한국어 中文",
    "Emoji: 🙂🚀👍🏽 🇫🇷  multiple   spaces\n\nnew lines\r\n and 'quotes' it's we'll",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def smollm2_reference(tmp_path_factory) -> dict:
    """ids (per reference tokenizer), prompt ids, greedy ids, logits and tokenizer dirs."""
    # Each test module that imports this fixture owns a copy of it: share the results on disk.
    out = tmp_path_factory.getbasetemp() / "smollm2-reference"
    if not (out / "smollm2.npz").is_file():
        job = {"gguf": smollm2_gguf(), "texts": TEXTS, "prompt": PROMPT, "new_tokens": NEW_TOKENS}
        run_reference("smollm2", job, out)
    result = json.loads((out / "smollm2.json").read_text())
    result["logits"] = np.load(out / "smollm2.npz")["logits"]
    result["dir"] = out
    return result
