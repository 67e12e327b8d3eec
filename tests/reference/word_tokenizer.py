"""A real `zoo.Tokenizer` of any size, built offline with HF tokenizers: one word per id, `</s>`
the end of sequence (for tests that need a tokenizer's stop ids or files, not its encoding)."""

import zoo


def word_tokenizer(vocab_size: int, eos: int) -> zoo.Tokenizer:
    """Words `w0`, `w1`, ... for ids 0 to `vocab_size - 1`, except `</s>` (special, eos) at
    `eos`."""
    from tokenizers import Tokenizer, models

    words = {("</s>" if i == eos else f"w{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.add_special_tokens(["</s>"])
    return zoo.Tokenizer(
        backend=backend, special_tokens={"</s>": eos}, named_tokens={"eos_token": "</s>"}
    )
