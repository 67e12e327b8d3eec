"""--init-from: fine-tuning starts from the loaded checkpoint's weights (the first step's loss is
the loaded model's loss on that batch) with its tokenizer, and training lowers the loss. The
run-time flags (--dtype, --param-dtype, --remat, --attention, run-time --override) apply to the
imported model; flags that would change its architecture are refused, naming the flag."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import train
import zoo
from training import checkpoint
from training.args import parse_args
from training.loss import loss_terms
from training.model_config import check_fits, imported_changes

TINY_LLAMA = zoo.preset("tiny-llama", vocab_size=320, n_layers=1)


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(directory, corpus, config=TINY_LLAMA):
    """A tiny zoo model written with save_pretrained, beside a byte-level BPE tokenizer.json."""
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
    zoo.save_pretrained(zoo.Transformer(config, key=jax.random.key(3)), directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus):
    return _checkpoint(tmp_path_factory.mktemp("pretrained"), corpus)


def test_finetune_starts_from_the_checkpoint_and_lowers_the_loss(tmp_path, tiny_argv, pretrained):
    path = pretrained
    argv = tiny_argv(tmp_path / "run", "--steps", "6", "--lr", "3e-3", init_from=path)
    summary = train.main(argv)

    args = parse_args(argv)
    _, train_data, _, _ = train.load_data(args)
    first = next(iter(train_data.iterate(0)))
    loaded = zoo.load_pretrained(path)
    terms = loss_terms(loaded, jax.tree.map(jnp.asarray, first))
    losses = {r["step"]: r["loss"] for r in _records(tmp_path / "run") if "loss" in r}
    np.testing.assert_allclose(losses[1], float(terms.nll_sum / terms.tokens), rtol=1e-5)
    assert summary["encoding"].n_vocab == 300
    assert summary["val_loss"] < summary["initial_val_loss"]


def test_run_time_flags_apply_to_the_imported_model(tmp_path, tiny_argv, corpus):
    # A bfloat16 checkpoint: its weights are read as float32 master weights (--param-dtype).
    half = TINY_LLAMA.replace(dtype="bfloat16", param_dtype="bfloat16")
    path = _checkpoint(tmp_path / "pretrained", corpus, half)
    flags = ["--attention", "naive", "--remat", "full", "--dtype", "bfloat16"]
    runtime = ["--override", "moe_z_loss_weight=0.5", "--override", "n_layers=1"]
    argv = tiny_argv(tmp_path / "run", *flags, *runtime, "--steps", "1", init_from=path)
    model = train.main(argv)["params"]

    settings = dict(attention="naive", remat="full", dtype="bfloat16", param_dtype="float32")
    assert model.config == half.replace(**settings, moe_z_loss_weight=0.5)
    assert model.blocks.attn.kernel == "naive"
    dtypes = {w.dtype for w in jax.tree.leaves(eqx.filter(model, eqx.is_array))}
    assert dtypes == {jnp.dtype("float32")}
    # The step ran on the checkpoint's weights, computing in bfloat16 with the naive kernel.
    _, train_data, _, _ = train.load_data(parse_args(argv))
    first = jax.tree.map(jnp.asarray, next(iter(train_data.iterate(0))))
    loaded = zoo.with_runtime(zoo.load_pretrained(path, dtype="float32"), **settings)
    terms = loss_terms(loaded, first)
    (record,) = [r for r in _records(tmp_path / "run") if "loss" in r]
    np.testing.assert_allclose(record["loss"], float(terms.nll_sum / terms.tokens), rtol=1e-2)


def test_init_from_a_run_directory(tmp_path, tiny_argv, full_run):
    old_dir, old = full_run
    argv = tiny_argv(tmp_path / "run", "--attention", "naive", "--steps", "1", init_from=old_dir)
    summary = train.main(argv)
    trained, tokenizer = checkpoint.load_run(old_dir)
    assert summary["params"].config == trained.config.replace(attention="naive")
    # Same data, same tokenizer (the run's own BPE): the new run starts where the old one ended.
    np.testing.assert_allclose(summary["initial_val_loss"], old["val_loss"], rtol=1e-5)
    _, recorded = checkpoint.load_run(tmp_path / "run")
    text = "def load(path):\n    return open(path).read()"
    assert recorded.encode(text) == tokenizer.encode(text) == old["encoding"].encode(text)


def test_flags_that_contradict_the_checkpoint_are_refused(tmp_path, tiny_argv, pretrained):
    with pytest.raises(ValueError, match="is this run's own directory"):
        train.main(tiny_argv(pretrained, init_from=pretrained))
    argv = tiny_argv(tmp_path / "run", init_from=pretrained)
    with pytest.raises(ValueError, match=r"--override n_layers=4 contradicts --init-from .*is 1"):
        train.main([*argv, "--override", "n_layers=4"])
    with pytest.raises(ValueError, match=r"--model 'tiny-llama' and --init-from .* both name"):
        train.main([*argv, "--model", "tiny-llama"])


def test_imported_changes_take_run_time_overrides_only():
    flags = ["--init-from", "ckpt", "--remat", "dots", "--param-dtype", "bfloat16"]
    args = parse_args([*flags, "--override", "moe_dispatch=capacity", "--override", "d_model=64"])
    changes = imported_changes(args, TINY_LLAMA.replace(d_model=64))
    assert changes == dict(
        dtype="float32", param_dtype="bfloat16", remat="dots", moe_dispatch="capacity"
    )
    with pytest.raises(ValueError, match=r"--override d_model=64 .* whose d_model is 32"):
        imported_changes(args, TINY_LLAMA.replace(d_model=32, n_heads=2, n_kv_heads=2))
    gpt2 = zoo.preset("tiny-gpt2", max_seq_len=8)
    args = parse_args(["--init-from", "ckpt", "--seq-len", "16"])
    with pytest.raises(ValueError, match=r"--seq-len 16 exceeds model 'ckpt'.s max_seq_len=8"):
        check_fits(gpt2, args, gpt2.vocab_size, "ckpt")
    with pytest.raises(ValueError, match=r"has 9999 tokens .* use a tokenizer with fewer"):
        check_fits(gpt2, args, 9999, "ckpt")
