"""Checkpoint files written by a stranger (issue 26): malformed JSON, values that would change
the model's meaning if read loosely, files outside their directory, and `overwrite` that must
delete only the model's own files. Each case is an error naming the file and the value, or the
meaning kept; the checkpoints are written by zoo and then damaged."""

import json
import math
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from tests.zoo.random_model import random_model
from zoo.adapter import has_lora

CONFIG = zoo.preset("tiny-llama", vocab_size=64, d_model=32, d_ff=48, max_seq_len=32)
INDEX = "model.safetensors.index.json"


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "llama"
    zoo.save_pretrained(random_model(CONFIG, 0), path)
    return path


@pytest.fixture
def adapter(tmp_path):
    """A PEFT adapter of CONFIG's model on q_proj (rank 4, alpha 8)."""
    model = zoo.add_lora(random_model(CONFIG, 0), ["q_proj"], 4, 8, key=jax.random.key(0))
    zoo.save_adapter(model, tmp_path / "adapter")
    return tmp_path / "adapter"


def edit_json(path, change):
    value = json.loads(path.read_text())
    path.write_text(json.dumps(change(value)))


# --- overwrite deletes only what is the model's ------------------------------------------------


def test_overwrite_keeps_an_adapter_and_removes_indexed_shards(checkpoint, adapter):
    for name in os.listdir(adapter):
        (checkpoint / name).write_bytes((adapter / name).read_bytes())
    tensors = load_file(checkpoint / "model.safetensors")
    save_file(tensors, checkpoint / "weights-a.safetensors", metadata={"format": "pt"})
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / INDEX).write_text(
        json.dumps({"weight_map": dict.fromkeys(tensors, "weights-a.safetensors")})
    )
    zoo.save_pretrained(random_model(CONFIG, 1), checkpoint, overwrite=True)
    assert sorted(os.listdir(checkpoint)) == [
        "adapter_config.json", "adapter_model.safetensors", "config.json", "model.safetensors"
    ]  # fmt: skip
    assert (checkpoint / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()
    zoo.load_adapter(zoo.load_pretrained(checkpoint), checkpoint)  # still a whole adapter


# --- malformed JSON ----------------------------------------------------------------------------

MALFORMED = [("[]", "holds a JSON list, not an object"), ("not json", "is not valid JSON")]


@pytest.mark.parametrize(("text", "message"), MALFORMED)
def test_malformed_config_json(checkpoint, text, message):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"config\.json {message}.*'architectures'"):
        zoo.load_pretrained(checkpoint)


def test_config_json_without_a_class(checkpoint):
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"must name exactly one class in 'architectures'"):
        zoo.load_pretrained(checkpoint)
    (checkpoint / "config.json").write_text('{"architectures": "LlamaForCausalLM"}')
    with pytest.raises(ValueError, match=r"must name exactly one class in 'architectures'"):
        zoo.load_pretrained(checkpoint)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        *MALFORMED,
        ("{}", "lacks the field 'weight_map'"),
        ('{"weight_map": []}', r"'weight_map' is \[\] \(a list\); it must be a dict"),
        ('{"weight_map": {}}', "has an empty weight_map"),
        ('{"weight_map": {"model.norm.weight": 3}}', "values must be shard file names"),
    ],
)
def test_malformed_index(checkpoint, text, message):
    (checkpoint / INDEX).write_text(text)
    with pytest.raises(ValueError, match=rf"index\.json.*{message}"):
        zoo.load_pretrained(checkpoint)


@pytest.mark.parametrize(
    ("text", "message"),
    [*MALFORMED, ("{}", r"peft_type=None; only 'LORA'")],
)
def test_malformed_adapter_config(adapter, text, message):
    (adapter / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"adapter_config\.json:? {message}"):
        zoo.load_adapter(random_model(CONFIG, 0), adapter)


# --- meaning: rope scaling ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "made-up"])
def test_rope_scaling_beside_default_rope_parameters_is_refused(checkpoint, kind):
    # transformers reads `rope_scaling or rope_parameters`: the scaling is the model's meaning.
    edit_json(
        checkpoint / "config.json", lambda c: c | {"rope_scaling": {"type": kind, "factor": 2.0}}
    )
    assert json.loads((checkpoint / "config.json").read_text())["rope_parameters"]
    with pytest.raises(ValueError, match=f"rope_type='{kind}' is not supported"):
        zoo.load_pretrained(checkpoint)


def test_rope_scaling_beside_default_rope_parameters_is_read(checkpoint):
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }  # fmt: skip
    edit_json(checkpoint / "config.json", lambda c: c | {"rope_scaling": scaling})
    assert zoo.load_pretrained(checkpoint).config.rope_scaling.factor == 8.0


def test_gemma3_rope_scaling_beside_nested_parameters_is_refused():
    from zoo.pretrained.architectures import architecture_for
    from zoo.pretrained.hf_config import config_from_hf, config_to_hf

    config = zoo.preset("gemma3-1b")
    hf = config_to_hf(architecture_for(config), config, "float32")
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        config_from_hf(hf | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


FAMILIES = {
    "LlamaForCausalLM": "smollm2-135m",
    "MistralForCausalLM": "mistral-7b",
    "MixtralForCausalLM": "mixtral-8x7b",
    "Qwen2ForCausalLM": "qwen2.5-0.5b",
    "Qwen3ForCausalLM": "qwen3-0.6b",
    "Qwen3MoeForCausalLM": "qwen3-30b-a3b",
    "Phi3ForCausalLM": "phi3-mini-4k",
}


@pytest.mark.parametrize("name", FAMILIES)
def test_refusals_name_the_family_being_loaded(name):
    """The Llama-like families read their config through Llama's: a refusal names the class
    in config.json, not Llama (a Phi-3 rope that is not LongRoPE is not called LongRoPE)."""
    from zoo.pretrained.architectures import architecture
    from zoo.pretrained.hf_config import config_from_hf, config_to_hf

    hf = config_to_hf(architecture(name), zoo.preset(FAMILIES[name]), "float32")
    for change, refused in [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} {refused}") as refusal:
            config_from_hf(hf | change)
        assert "Llama" not in str(refusal.value).replace(name, "") or name == "LlamaForCausalLM"
        assert "LongRoPE" not in str(refusal.value)


# --- meaning: tensors --------------------------------------------------------------------------


def test_integer_tensor_for_a_float_weight_is_refused(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype int32; model weights"):
        zoo.load_pretrained(checkpoint)


# --- meaning: adapters -------------------------------------------------------------------------

Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora_alpha": math.nan}, r"lora_alpha=nan; it must be a finite number"),
        ({"lora_alpha": "16"}, r"'lora_alpha' is '16' \(a str\)"),
        ({"r": 4.9}, r"'r' is 4\.9 \(a float\); it must be a int"),
        ({"r": 0}, r"r=0; the rank must be an integer >= 1"),
        ({"lora_dropout": 1.5}, r"lora_dropout=1\.5; it must be in \[0, 1\)"),
        ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\] is not supported"),
        ({"layers_pattern": "layers", "layers_to_transform": 1}, "layers_to_transform=1 is not"),
        ({"lora_bias": True}, "lora_bias=True is not supported"),
        ({"new_peft_feature": 1}, r"does not implement: \['new_peft_feature'\]"),
    ],
)
def test_adapter_config_values_that_would_change_the_meaning(adapter, change, message):
    edit_json(adapter / "adapter_config.json", lambda c: c | change)
    with pytest.raises(ValueError, match=message):
        zoo.load_adapter(random_model(CONFIG, 0), adapter)


def test_adapter_config_harmless_fields_load(adapter):
    peft_defaults = {"init_lora_weights": True, "layers_pattern": None, "loftq_config": {}}
    edit_json(adapter / "adapter_config.json", lambda c: c | peft_defaults)
    assert has_lora(zoo.load_adapter(random_model(CONFIG, 0), adapter))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda a: a.astype(np.int32), "has dtype int32; LoRA weights are floating point"),
        (lambda a: np.full_like(a, np.nan), "holds NaN or infinite values"),
    ],
)
def test_adapter_tensors_that_are_not_finite_floats(adapter, damage, message):
    file = adapter / "adapter_model.safetensors"
    tensors = load_file(file)
    tensors[Q0A] = damage(tensors[Q0A])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{Q0A} {message}"):
        zoo.load_adapter(random_model(CONFIG, 0), adapter)


@pytest.mark.parametrize(
    ("rank", "alpha", "error", "message"),
    [
        (4, math.nan, ValueError, "LoRA alpha must be finite, got nan"),
        (4, math.inf, ValueError, "LoRA alpha must be finite, got inf"),
        # A bool passes the `int` annotation (the runtime type check of the tests included).
        (True, 8, ValueError, "LoRA rank must be an integer >= 1, got True"),
    ],
)
def test_add_lora_refuses_settings_that_change_the_meaning(rank, alpha, error, message):
    with pytest.raises(error, match=message):
        zoo.add_lora(random_model(CONFIG, 0), ["q_proj"], rank, alpha, key=jax.random.key(0))


# --- files outside their directory -------------------------------------------------------------


def test_adapter_weights_symlinked_out_of_the_directory_are_refused(adapter, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (adapter / "adapter_model.safetensors").rename(outside)
    (adapter / "adapter_model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="which is not a file of that directory"):
        zoo.load_adapter(random_model(CONFIG, 0), adapter)


def test_model_weights_symlinked_out_of_the_directory_are_refused(checkpoint, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (checkpoint / "model.safetensors").rename(outside)
    (checkpoint / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="which is not a file of that directory"):
        zoo.load_pretrained(checkpoint)


def test_hf_hub_cache_layout_loads(checkpoint, adapter, tmp_path):
    # huggingface_hub's cache: <repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>.
    for source, repo in ((checkpoint, "models--zoo--llama"), (adapter, "models--zoo--adapter")):
        blobs, snapshot = tmp_path / repo / "blobs", tmp_path / repo / "snapshots" / "abc123"
        blobs.mkdir(parents=True)
        snapshot.mkdir(parents=True)
        for i, name in enumerate(sorted(os.listdir(source))):
            (blobs / f"hash{i}").write_bytes((source / name).read_bytes())
            (snapshot / name).symlink_to(f"../../blobs/hash{i}")
    model = zoo.load_pretrained(tmp_path / "models--zoo--llama" / "snapshots" / "abc123")
    adapted = zoo.load_adapter(model, tmp_path / "models--zoo--adapter" / "snapshots" / "abc123")
    assert has_lora(adapted)


# --- GGUF metadata -----------------------------------------------------------------------------


def _gguf_with(tmp_path, extra: dict, name: str, tensors: dict | None = None) -> str:
    """A qwen2 GGUF of a tiny model (as llama.cpp's converter writes it) with `extra` metadata
    and `tensors`."""
    import gguf

    from tests.zoo.test_families import GGUF_MODELS, write_gguf

    hf_class, arch, config = GGUF_MODELS["qwen2"]
    if not (tmp_path / "plain.gguf").exists():
        write_gguf(random_model(config, 0), hf_class, arch, tmp_path / "plain.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "plain.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / name), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("qwen2."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for key, value in extra.items():
        kind = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    for tensor_name, value in (tensors or {}).items():
        writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(tmp_path / name)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"qwen2.rope.scaling.type": "yarn"},
            r"qwen2\.rope\.scaling\.type='yarn' is not supported",
        ),
        ({"qwen2.expert_count": 8}, r"qwen2\.expert_count=8 is not supported"),
        ({"qwen2.attention.value_length": 4}, "value_length=4 differs from the key heads' 8"),
        ({"qwen2.new_feature": 1}, r"qwen2\.new_feature is not read by the zoo"),
    ],
)
def test_gguf_metadata_the_zoo_would_ignore_is_refused(tmp_path, extra, message):
    assert zoo.load_pretrained(_gguf_with(tmp_path, {"qwen2.rope.scaling.type": "none"}, "a.gguf"))
    with pytest.raises(ValueError, match=message):
        zoo.load_pretrained(_gguf_with(tmp_path, extra, "b.gguf"))


@pytest.mark.parametrize(("tensor", "kind"), [("rope_freqs", "frequency factors"),
                                              ("rope_factors_long", "LongRoPE")])  # fmt: skip
def test_gguf_rope_scaling_tensors_are_refused_naming_the_architecture(tmp_path, tensor, kind):
    path = _gguf_with(tmp_path, {}, "scaled.gguf", {f"{tensor}.weight": np.ones(4, np.float32)})
    refusal = rf"this qwen2 GGUF stores rope scaling as a {tensor} tensor \({kind}\)"
    with pytest.raises(ValueError, match=refusal):
        zoo.load_pretrained(path)
