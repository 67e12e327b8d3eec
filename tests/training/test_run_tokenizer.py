"""A run directory carries its tokenizer: `load_run` decodes with the one train.py used."""

from training import run_dir


def test_load_run_recovers_the_trained_bpe(full_run):
    directory, summary = full_run
    model, tokenizer = run_dir.load_run(directory)
    trained = summary.encoding
    text = "def load(path):\n    return open(path).read()  # ünïcode"
    assert tokenizer.encode(text, allowed_special="all") == trained.encode(
        text, allowed_special="all"
    )
    assert model.config.vocab_size == 320
