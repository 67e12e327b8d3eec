"""training.artifacts names a model one way everywhere: each kind of artifact is told apart,
and a path that is none of them, an adapter given as a model, an adapter on a LoRA run and an
export without a tokenizer are refused with what to do instead."""

import jax
import numpy as np
import pytest

import zoo
from tests.reference.word_tokenizer import word_tokenizer
from tests.zoo.test_gguf_quantized import write_gguf
from training.artifacts import (
    Artifact,
    artifact_config,
    artifact_kind,
    export,
    load_artifact,
    with_adapter,
)
from zoo.quantize import quantized_formats


def test_each_kind_is_told_apart(tmp_path):
    assert artifact_kind("tiny-llama") == "preset"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert artifact_kind(str(tmp_path / "hf")) == "hf"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    assert artifact_kind(str(tmp_path / "run")) == "run"
    (tmp_path / "m.gguf").write_bytes(b"")
    assert artifact_kind(str(tmp_path / "m.gguf")) == "gguf"
    assert artifact_config("tiny-llama") == zoo.preset("tiny-llama")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "is none of: a zoo preset name, an HF model directory"),
        (lambda d: d.mkdir(), "is a directory but none of"),
        (lambda d: (d.mkdir(), (d / "adapter_config.json").write_text("{}")),
         "is a PEFT adapter, not a model: give its base with --model and this directory with "
         "--adapter"),
    ],
)  # fmt: skip
def test_what_is_no_model_says_what_is_expected(tmp_path, make, message):
    make(tmp_path / "thing")
    with pytest.raises(ValueError, match=message):
        artifact_kind(str(tmp_path / "thing"))
    with pytest.raises(ValueError, match="the GGUF file does not exist"):
        artifact_kind(str(tmp_path / "missing.gguf"))


def test_an_adapter_on_a_model_that_has_adapters_is_refused(tmp_path):
    base = zoo.Transformer(zoo.preset("tiny-llama"), key=jax.random.key(0))
    adapted = zoo.add_lora(base, ["q_proj"], 2, 4, key=jax.random.key(1))
    zoo.save_adapter(adapted, tmp_path / "adapter")
    zoo.save_pretrained(base, tmp_path / "base")
    loaded = load_artifact(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"), log=str)
    assert loaded.kind == "hf" and loaded.tokenizer is None  # no tokenizer.json there

    with pytest.raises(ValueError, match="already holds LoRA adapters"):
        with_adapter(loaded.model, str(tmp_path / "adapter"), "runs/lora", None)
    with pytest.raises(ValueError, match="comes with no tokenizer, and an HF directory needs"):
        export(Artifact(loaded.model, None, "hf", "base"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_quantized_gguf_exports_the_float_weights_its_blocks_stand_for(tmp_path):
    """An HF directory holds no packed blocks: export writes what they stand for, and the
    directory loads back to the model the GGUF computes when dequantized."""
    path = write_gguf(tmp_path / "m.gguf")
    packed = zoo.load_pretrained(path)
    assert quantized_formats(packed)
    tokenizer = word_tokenizer(packed.config.vocab_size, eos=2)
    export(Artifact(packed, tokenizer, "gguf", path), tmp_path / "out", log=str)
    back = zoo.load_pretrained(tmp_path / "out")
    floats = zoo.load_pretrained(path, quantized=False)
    assert not quantized_formats(back)
    for a, b in zip(jax.tree.leaves(floats), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)  # the same float32 values: written and read as is
    assert zoo.load_tokenizer(tmp_path / "out").stop_ids() == (2,)
