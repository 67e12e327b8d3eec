"""--init-from: fine-tuning starts from the loaded checkpoint's weights (the first step's loss is
the loaded model's loss on that batch) with its tokenizer, loaded straight into the run's
placement, and training lowers the loss. The run-time flags (--dtype, --param-dtype, --remat,
--attention) are the imported model's policy; flags that would change its architecture are
refused, naming the flag."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
import zoo
from tests.training.conftest import TINY_LLAMA, write_checkpoint
from training import run_model
from training.args import parse_args
from training.loss import loss_terms
from training.model_config import check_fits, check_imported, policy


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus):
    return write_checkpoint(tmp_path_factory.mktemp("pretrained"), corpus)


def test_finetune_starts_from_the_checkpoint_and_lowers_the_loss(tmp_path, tiny_argv, pretrained):
    path = pretrained
    argv = tiny_argv(tmp_path / "run", "--steps", "6", "--lr", "3e-3", init_from=path)
    summary = train.main(argv)

    args = parse_args(argv)
    _, train_data, *_ = train.load_data(args, tmp_path / "run")
    first = next(iter(train_data.iterate(0)))
    loaded = zoo.load_pretrained(path)
    terms = loss_terms(loaded, jax.tree.map(jnp.asarray, first))
    losses = {r["step"]: r["loss"] for r in _records(tmp_path / "run") if "loss" in r}
    np.testing.assert_allclose(losses[1], float(terms.nll_sum / terms.tokens), rtol=1e-5)
    assert summary.encoding.n_vocab == 300
    assert summary.val_loss < summary.initial_val_loss


def test_run_time_flags_apply_to_the_imported_model(tmp_path, tiny_argv, corpus):
    # A bfloat16 checkpoint: its weights are read as float32 master weights (--param-dtype).
    path = write_checkpoint(tmp_path / "pretrained", corpus, dtype="bfloat16")
    flags = ["--attention", "naive", "--remat", "full", "--dtype", "bfloat16"]
    # An --override that repeats the checkpoint's architecture is allowed.
    argv = tiny_argv(tmp_path / "run", *flags, "--override", "n_layers=1", "--steps", "1",
                     init_from=path)  # fmt: skip
    model = train.main(argv).model

    settings = dict(attention="naive", remat="full", compute_dtype="bfloat16")
    assert model.config == TINY_LLAMA
    assert model.policy == zoo.Policy(**settings)
    dtypes = {w.dtype for w in jax.tree.leaves(eqx.filter(model, eqx.is_array))}
    assert dtypes == {jnp.dtype("float32")}
    # The step ran on the checkpoint's weights, computing in bfloat16 with the naive kernel.
    _, train_data, *_ = train.load_data(parse_args(argv), tmp_path / "run")
    first = jax.tree.map(jnp.asarray, next(iter(train_data.iterate(0))))
    loaded = zoo.load_pretrained(path, policy=zoo.Policy(**settings))
    terms = loss_terms(loaded, first)
    (record,) = [r for r in _records(tmp_path / "run") if "loss" in r]
    np.testing.assert_allclose(record["loss"], float(terms.nll_sum / terms.tokens), rtol=1e-2)


def test_init_from_a_run_directory(tmp_path, tiny_argv, full_run):
    old_dir, old = full_run
    argv = tiny_argv(tmp_path / "run", "--attention", "naive", "--steps", "1", init_from=old_dir)
    summary = train.main(argv)
    trained, tokenizer = run_model.load_run(old_dir)
    assert summary.model.config == trained.config
    assert summary.model.policy.kernel_name == "naive"
    # Same data, same tokenizer (the run's own BPE): the new run starts where the old one ended.
    np.testing.assert_allclose(summary.initial_val_loss, old.val_loss, rtol=1e-5)
    _, recorded = run_model.load_run(tmp_path / "run")
    text = "def load(path):\n    return open(path).read()"
    assert recorded.encode(text) == tokenizer.encode(text) == old.encoding.encode(text)


def test_init_from_loads_straight_into_the_mesh(tmp_path, tiny_argv, pretrained):
    argv = tiny_argv(tmp_path / "run", "--mesh", "fsdp=4,tensor=2", "--steps", "1",
                     init_from=pretrained)  # fmt: skip
    model = train.main(argv).model
    q_proj = model.stacks[0].blocks[0].attn.q_proj.weight
    # layers embed heads d; the layer axis maps to `pipeline` (size 1 here: not split).
    assert q_proj.sharding.spec == jax.P("pipeline", "fsdp", "tensor", None)


def test_flags_that_contradict_the_checkpoint_are_refused(tmp_path, tiny_argv, pretrained):
    with pytest.raises(ValueError, match="is this run's own directory"):
        train.main(tiny_argv(pretrained, init_from=pretrained))
    argv = tiny_argv(tmp_path / "run", init_from=pretrained)
    with pytest.raises(ValueError, match=r"--override n_layers=4 contradicts --init-from .*is 1"):
        train.main([*argv, "--override", "n_layers=4"])
    with pytest.raises(ValueError, match=r"--model 'tiny-llama' and --init-from .* both name"):
        train.main([*argv, "--model", "tiny-llama"])


def test_the_policy_comes_from_the_flags_and_overrides_must_agree(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")  # a checkpoint, as far as flags see
    ckpt = str(tmp_path / "ckpt")
    flags = ["--init-from", ckpt, "--remat", "dots", "--param-dtype", "bfloat16"]
    args = parse_args([*flags, "--moe-dispatch", "capacity", "--override", "d_model=64"])
    assert policy(args) == zoo.Policy(param_dtype="bfloat16", remat="dots", moe_dispatch="capacity")
    check_imported(args, TINY_LLAMA.replace(d_model=64))  # repeats the checkpoint's value
    with pytest.raises(ValueError, match=r"--override d_model=64 .* whose d_model is 32"):
        check_imported(args, TINY_LLAMA.replace(d_model=32, n_heads=2, n_kv_heads=2))
    gpt2 = zoo.preset("tiny-gpt2", max_seq_len=8)
    args = parse_args(["--init-from", ckpt, "--seq-len", "16"])
    with pytest.raises(ValueError, match=r"--seq-len 16 \(16 tokens\) exceeds Config"):
        check_fits(gpt2, args, gpt2.vocab_size, "ckpt")
    with pytest.raises(ValueError, match=r"has 9999 tokens .* use a tokenizer with fewer"):
        check_fits(gpt2, args, 9999, "ckpt")
