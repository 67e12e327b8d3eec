"""--init-from: fine-tuning starts from the loaded checkpoint's weights (the first step's loss is
the loaded model's loss on that batch) with its tokenizer, and training lowers the loss."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import train
import zoo
from training.args import parse_args
from training.loss import loss_terms


def _checkpoint(directory, corpus):
    """A tiny zoo Llama written with save_pretrained, beside a byte-level BPE tokenizer.json."""
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    config = zoo.preset("tiny-llama", vocab_size=320, n_layers=1)
    zoo.save_pretrained(zoo.Transformer(config, key=jax.random.key(3)), directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_finetune_starts_from_the_checkpoint_and_lowers_the_loss(tmp_path, tiny_argv, corpus):
    path = _checkpoint(tmp_path / "pretrained", corpus)
    argv = tiny_argv(tmp_path / "run", "--init-from", str(path), "--steps", "6", "--lr", "3e-3")
    summary = train.main(argv)

    args = parse_args(argv)
    _, train_data, _, _ = train.load_data(args)
    first = next(iter(train_data.iterate(0)))
    loaded = zoo.load_pretrained(path)
    terms = loss_terms(loaded, jax.tree.map(jnp.asarray, first))
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    np.testing.assert_allclose(losses[1], float(terms.nll_sum / terms.tokens), rtol=1e-5)
    assert summary["encoding"].n_vocab == 300
    assert summary["val_loss"] < summary["initial_val_loss"]
