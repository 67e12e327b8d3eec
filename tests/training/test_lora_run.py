"""train.py --lora-rank: only the adapters train (the base checkpoint's weights come out
bit-identical), checkpoints hold the adapters and their optimizer state alone, --resume continues
bit for bit, a run's model loads back (base + adapters) with the same logits, and a base that
changed under the run, targets that match nothing and --base-dtype without LoRA are refused.
Quantized bases (int8, NF4) train too."""

import json
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
import zoo
from layers import QuantizedLinear
from tests.training.conftest import stopped_copy, write_checkpoint
from training import run_dir, run_model
from training.state import saved_arrays
from zoo.adapter import has_lora, split_trainable

LORA = ("--lora-rank", "2", "--lora-alpha", "4", "--lr", "3e-2")


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus):
    return write_checkpoint(tmp_path_factory.mktemp("base"), corpus)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus, cache_dir, base):
    from tests.training.conftest import make_argv

    out = tmp_path_factory.mktemp("lora")
    argv = make_argv(corpus, cache_dir)(out, *LORA, "--steps", "4", init_from=base)
    return out, train.main(argv)


def _resume(run: Path, steps: int) -> list[str]:
    return ["--resume", str(run), "--steps", str(steps), "--no-progress",
            "--peak-flops", "1e11", "--peak-bandwidth", "1e10"]  # fmt: skip


def _losses(path) -> dict[int, float]:
    lines = (json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_only_the_adapters_train_and_the_base_is_untouched(lora_run, base):
    _, result = lora_run
    assert has_lora(result.model)
    # The frozen part flattens as the base does (each LoRA holds its base where the Linear was).
    _, frozen = split_trainable(result.model)
    loaded = zoo.load_pretrained(base, policy=zoo.Policy())  # stacked, as train.py loads it
    for a, b in zip(
        jax.tree.leaves(eqx.filter(loaded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(frozen, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # The adapters moved away from B = 0.
    trainable, _ = split_trainable(result.model)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(trainable))
    assert result.val_loss < result.initial_val_loss


def test_checkpoints_hold_the_adapters_alone(lora_run):
    out, result = lora_run
    n_adapter = sum(x.size for x in jax.tree.leaves(split_trainable(result.model)[0]))
    n_model = zoo.math.param_count(result.model.config)
    assert n_adapter < n_model / 10

    def stored(item: str) -> int:
        arrays = saved_arrays(run_dir.latest(out), item).values()
        return sum(math.prod(a.shape) for a in arrays)

    # The adapters, and their two AdamW moments (plus a few step counts); no base weight.
    assert stored("params") == n_adapter
    assert 2 * n_adapter <= stored("opt_state") < 2 * n_adapter + 8
    record = json.loads((out / "run.json").read_text())
    assert record["settings"]["lora_rank"] == 2
    assert len(record["base"]["sha256"]) == 64


def test_resume_continues_bit_for_bit(lora_run, tmp_path):
    full_dir, full = lora_run
    resumed_dir = stopped_copy(full_dir, tmp_path / "resumed", step=2)
    resumed = train.main(_resume(resumed_dir, 4))
    full_losses, resumed_losses = _losses(full_dir), _losses(resumed_dir)
    assert sorted(resumed_losses) == [1, 2, 3, 4]
    assert all(resumed_losses[s] == full_losses[s] for s in resumed_losses)
    a = jax.tree.leaves(split_trainable(full.model)[0])
    b = jax.tree.leaves(split_trainable(resumed.model)[0])
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_run_loads_back_with_its_adapters(lora_run):
    out, result = lora_run
    model, _ = run_model.load_run(out)
    tokens = jnp.array([[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(model(tokens), result.model(tokens))


def test_a_changed_base_is_refused(tmp_path, corpus, cache_dir, tiny_argv):
    base = write_checkpoint(tmp_path / "base", corpus)
    out = tmp_path / "run"
    train.main(tiny_argv(out, *LORA, "--steps", "2", init_from=base))
    rewritten = zoo.Transformer(zoo.load_pretrained(base).config, key=jax.random.key(9))
    tokenizer = (base / "tokenizer.json").read_bytes()
    zoo.save_pretrained(rewritten, base, overwrite=True)  # new weights, same tokenizer
    (base / "tokenizer.json").write_bytes(tokenizer)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="whose files changed since the run started"):
        train.main(_resume(out, 4))
    with pytest.raises(ValueError, match="whose files changed since the run started"):
        run_model.load_run(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_quantized_base_trains(tmp_path, tiny_argv, base, kind):
    result = train.main(
        tiny_argv(tmp_path / "run", *LORA, "--base-dtype", kind, "--steps", "2", init_from=base)
    )
    assert np.isfinite(result.loss)
    quantized = [
        n
        for n in jax.tree.leaves(result.model, is_leaf=lambda n: isinstance(n, QuantizedLinear))
        if isinstance(n, QuantizedLinear)
    ]
    assert quantized and all(q.kind == kind for q in quantized)


def test_bad_lora_settings(tmp_path, tiny_argv, base, capsys):
    with pytest.raises(SystemExit):
        train.main(tiny_argv(tmp_path / "a", "--base-dtype", "int8", init_from=base))
    assert "argument --base-dtype: int8 sets how a frozen base is held" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--lora-targets 'wq'.*q_proj"):
        train.main(tiny_argv(tmp_path / "b", *LORA, "--lora-targets", "wq", init_from=base))
