"""A run directory carries its tokenizer: `load_run` decodes with the one train.py used."""

from training import run_model


def test_load_run_recovers_the_trained_bpe(full_run):
    directory, summary = full_run
    model, tokenizer = run_model.load_run(directory)
    trained = summary.encoding
    text = "def load(path):\n    return open(path).read()  # ünïcode"
    # The trained BPE (tiktoken ranks) as a zoo.Tokenizer: the same ids.
    assert tokenizer.encode(text + "<|endoftext|>") == trained.encode(
        text + "<|endoftext|>", allowed_special="all"
    )
    assert model.config.vocab_size == 320
