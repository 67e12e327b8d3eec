"""`save_tokenizer`: a `Tokenizer` as the files of an HF tokenizer, which transformers'
`AutoTokenizer.from_pretrained` and `zoo.load_tokenizer` read back to the same ids and template."""

import json
import os

from zoo.tokenizer.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    """Write tokenizer.json (the `tokenizers` pipeline as it is) and tokenizer_config.json (the
    named special tokens and the chat template, under transformers' generic fast-tokenizer class,
    which uses tokenizer.json as written) into `directory`."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer.named_tokens,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
