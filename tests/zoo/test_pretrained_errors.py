"""Every bad checkpoint gets a clear error that names what is wrong (no reference venv needed:
the checkpoints are written by zoo.save_pretrained and then damaged)."""

import json

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from tests.zoo.random_model import random_model

CONFIG = zoo.preset("tiny-llama", vocab_size=64, d_model=32, d_ff=48, max_seq_len=32)


@pytest.fixture
def checkpoint(tmp_path):
    """A valid tiny Llama directory; tests damage it."""
    path = tmp_path / "llama"
    zoo.save_pretrained(random_model(CONFIG, 0), path)
    return path


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def test_valid_checkpoint_loads(checkpoint):
    # The damaged copies below fail for the damage, not for something else.
    assert zoo.load_pretrained(checkpoint).config == CONFIG


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        zoo.load_pretrained(tmp_path)


def test_path_that_is_neither_directory_nor_gguf(tmp_path):
    with pytest.raises(ValueError, match=r"neither an HF model directory nor a \.gguf file"):
        zoo.load_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="does not exist"):
        zoo.load_pretrained(tmp_path / "missing.gguf")


def test_unknown_architecture_is_named_with_the_known_ones(checkpoint):
    edit_config(checkpoint, architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match="'MambaForCausalLM' is not supported") as error:
        zoo.load_pretrained(checkpoint)
    assert "GPT2LMHeadModel" in str(error.value) and "LlamaForCausalLM" in str(error.value)


def test_missing_config_field_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["intermediate_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks the field 'intermediate_size'"):
        zoo.load_pretrained(checkpoint)


def test_unknown_rope_type(checkpoint):
    edit_config(checkpoint, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        zoo.load_pretrained(checkpoint)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # A field the zoo has never heard of may change the math: refused, named.
        ("attn_temperature", 0.5, r"does not implement: \['attn_temperature'\]"),
        # A feature implemented at one value only.
        ("pretraining_tp", 2, r"pretraining_tp=2, which the zoo does not implement"),
    ],
)
def test_unimplemented_config_field_is_refused(checkpoint, field, value, message):
    edit_config(checkpoint, **{field: value})
    with pytest.raises(ValueError, match=message):
        zoo.load_pretrained(checkpoint)


def test_harmless_config_fields_are_accepted(checkpoint):
    edit_config(checkpoint, pretraining_tp=1, attention_dropout=0.1, use_cache=False)
    assert zoo.load_pretrained(checkpoint).config == CONFIG


def test_missing_tensor_is_named(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        zoo.load_pretrained(checkpoint)


def test_extra_tensor_is_named(checkpoint):
    extra = "model.layers.0.self_attn.sinks"
    rewrite(checkpoint, lambda t: t.update({extra: np.zeros(4, np.float32)}))
    with pytest.raises(ValueError, match=rf"has 1 tensor.*does not: {extra}"):
        zoo.load_pretrained(checkpoint)


def test_wrong_shape_names_tensor_and_both_shapes(checkpoint):
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite(checkpoint, lambda t: t.update({name: np.zeros((32, 32), np.float32)}))
    with pytest.raises(ValueError, match=rf"{name} has shape \(32, 32\).*needs \(16, 32\)"):
        zoo.load_pretrained(checkpoint)


def test_truncated_safetensors(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        zoo.load_pretrained(checkpoint)


def test_pickle_checkpoints_are_refused(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"never pickled \.bin"):
        zoo.load_pretrained(checkpoint)


def test_unsupported_dtype(checkpoint):
    with pytest.raises(ValueError, match=r"Policy\.param_dtype='int8' is unknown"):
        zoo.load_pretrained(checkpoint, policy=zoo.Policy(param_dtype="int8"))
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"dtype": "int8"}))
    with pytest.raises(ValueError, match=r"config\.json dtype='int8' is not supported"):
        zoo.load_pretrained(checkpoint)


def test_config_without_an_hf_architecture_cannot_be_saved(tmp_path):
    model = random_model(CONFIG.replace(norm="layernorm"), 0)
    with pytest.raises(ValueError, match="no HF architecture holds this Config"):
        zoo.save_pretrained(model, tmp_path)


def write_gguf(path, architecture: str) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_another_architecture(tmp_path):
    write_gguf(tmp_path / "other.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported.*llama"):
        zoo.load_pretrained(tmp_path / "other.gguf")


def test_truncated_gguf(tmp_path):
    write_gguf(tmp_path / "cut.gguf", "llama")
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        zoo.load_pretrained(tmp_path / "cut.gguf")


def test_sharded_checkpoints_and_a_missing_shard(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    index = {"weight_map": {n: "model.safetensors" for n in tensors}}
    index["weight_map"]["model.norm.weight"] = "other.safetensors"
    save_file(
        {"model.norm.weight": tensors.pop("model.norm.weight")}, checkpoint / "other.safetensors"
    )
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert zoo.load_pretrained(checkpoint).config == CONFIG
    (checkpoint / "other.safetensors").unlink()
    with pytest.raises(ValueError, match=r"lists the shard other\.safetensors, which is not in"):
        zoo.load_pretrained(checkpoint)


MIXTRAL = zoo.preset("tiny-moe", vocab_size=64, d_model=32, d_ff=48, moe_d_ff=None, max_seq_len=32)


@pytest.fixture
def mixtral(tmp_path):
    """A valid tiny Mixtral directory (per-expert layout); tests damage it."""
    path = tmp_path / "mixtral"
    zoo.save_pretrained(random_model(MIXTRAL, 0), path)
    return path


def fuse_experts(tensors: dict) -> None:
    """Per-expert Mixtral tensors -> transformers 5's stacked layout, in place."""
    for i in range(MIXTRAL.n_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        w = {
            k: np.stack([tensors.pop(f"{old}experts.{e}.{k}.weight") for e in range(4)])
            for k in ("w1", "w2", "w3")
        }
        tensors[f"{new}experts.gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], axis=1)
        tensors[f"{new}experts.down_proj"] = w["w2"]
        tensors[f"{new}gate.weight"] = tensors.pop(f"{old}gate.weight")


def test_fused_mixtral_loads_the_same_weights(mixtral):
    per_expert = zoo.load_pretrained(mixtral)
    rewrite(mixtral, fuse_experts)
    fused = zoo.load_pretrained(mixtral)
    for a, b in zip(jax.tree.leaves(per_expert), jax.tree.leaves(fused), strict=True):
        np.testing.assert_array_equal(a, b)


def test_missing_expert_tensor_is_named(mixtral):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite(mixtral, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"lacks 1 tensor.*MixtralForCausalLM.*{name}"):
        zoo.load_pretrained(mixtral)


def test_missing_fused_expert_tensor_is_named(mixtral):
    name = "model.layers.1.mlp.experts.down_proj"
    rewrite(mixtral, lambda t: (fuse_experts(t), t.pop(name)))
    with pytest.raises(ValueError, match=rf"lacks 1 tensor.*{name}"):
        zoo.load_pretrained(mixtral)


def test_mixtral_expert_count_is_checked_against_config(mixtral):
    edit_config(mixtral, num_local_experts=3)
    # Expert 3 of each layer is more than a 3-expert config.json has.
    with pytest.raises(ValueError, match=r"has 6 tensor.*does not: .*experts\.3\.w1\.weight"):
        zoo.load_pretrained(mixtral)


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_save_pretrained_refuses_a_non_empty_directory(checkpoint):
    (checkpoint / "tokenizer.json").write_text("{}")  # a foreign tokenizer
    before = _files(checkpoint)
    with pytest.raises(ValueError, match=r"is not empty; .* overwrite=True"):
        zoo.save_pretrained(random_model(CONFIG, 1), checkpoint)
    assert _files(checkpoint) == before


def test_overwrite_leaves_no_stale_index_or_tokenizer(checkpoint):
    # An old sharded layout: its index would win over a new model.safetensors on load.
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, checkpoint / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, checkpoint / "model-00002-of-00002.safetensors")
    (checkpoint / "model.safetensors").unlink()
    index = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (checkpoint / "tokenizer.json").write_text("{}")
    (checkpoint / "notes.txt").write_text("mine")
    new = random_model(CONFIG, 1)
    zoo.save_pretrained(new, checkpoint, overwrite=True)
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "config.json", "model.safetensors", "notes.txt"
    ]  # fmt: skip
    loaded = zoo.load_pretrained(checkpoint, policy=new.policy)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(a, b)


def test_index_naming_a_shard_outside_the_directory_is_refused(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    (checkpoint / "model.safetensors").unlink()
    index = {"weight_map": {name: "../x.safetensors" for name in tensors}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'\.\./x\.safetensors', which is not a file of that"):
        zoo.load_pretrained(checkpoint)
