"""A run directory carries its tokenizer: `load_run` decodes with the one train.py used."""

from training import checkpoint


def test_load_run_recovers_the_trained_bpe(full_run):
    run_dir, summary = full_run
    model, tokenizer = checkpoint.load_run(run_dir)
    trained = summary["encoding"]
    text = "def load(path):\n    return open(path).read()  # ünïcode"
    assert tokenizer.encode(text, allowed_special="all") == trained.encode(
        text, allowed_special="all"
    )
    assert model.config.vocab_size == 320
