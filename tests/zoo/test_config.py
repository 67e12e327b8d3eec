"""Config checks, presets and their parameter counts."""

import json

import pytest

import zoo
from zoo import Config


def test_published_parameter_counts():
    assert zoo.math.param_count(zoo.preset("gpt2-124m")) == 124_439_808
    assert zoo.math.param_count(zoo.preset("llama3-8b")) == 8_030_261_248
    assert zoo.math.param_count(zoo.preset("smollm2-135m")) == 134_515_008
    assert zoo.math.param_count(zoo.preset("llama3-1b")) == 1_235_814_400
    assert zoo.math.param_count(zoo.preset("llama3-70b")) == 70_553_706_496


def test_every_preset_is_valid():
    for name in zoo.presets():
        config = zoo.preset(name)
        assert config.n_heads % config.n_kv_heads == 0
        assert zoo.math.param_count(config) > 0


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="gpt2-124m") as err:
        zoo.preset("gpt5")
    assert "unknown preset 'gpt5'" in str(err.value)


def base(**changes):
    fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)
    fields.update(changes)
    return Config(**fields)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"d_model": 30}, "d_model"),
        ({"position": "learned", "head_dim": 16}, "d_model"),
        ({"norm": "batchnorm"}, "norm"),
        ({"position": "alibi"}, "position"),
        ({"mlp": "relu"}, "mlp"),
        ({"n_layers": "two"}, "n_layers"),
        ({"n_layers": 2.0}, "n_layers"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"norm_eps": "1e-5"}, "norm_eps"),
        ({"max_seq_len": True}, "max_seq_len"),
        ({"n_layers": 0}, "n_layers"),
        ({"head_dim": 7}, "head_dim"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_impossible_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        base(**changes)


def test_derived_sizes():
    config = base(n_kv_heads=2)
    assert (config.head_dim, config.q_dim, config.kv_dim) == (8, 32, 16)
    wider = config.replace(d_model=64)
    assert wider.head_dim == 16 and wider.n_kv_heads == 2
    assert base().replace(n_heads=2).n_kv_heads == 2


def test_config_is_hashable_and_frozen():
    config = base()
    assert hash(config) == hash(base())
    with pytest.raises(AttributeError):
        config.d_model = 8


def test_json_round_trip():
    config = zoo.preset("llama3-8b")  # rope scaling: a nested dataclass
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_layers": "two"}, "Config.n_layers must be int, got 'two'"),
        ({"dtype": "float32"}, "unknown Config fields \\['dtype'\\]"),
        ({"rope_scaling": {"factor": 2.0, "bogus": 1}}, "rope_scaling"),
    ],
)
def test_json_errors_name_the_field_and_the_source(fields, message):
    good = base().to_dict()
    with pytest.raises(ValueError, match=f"my.json: .*{message}"):
        Config.from_dict(good | fields, source="my.json")


def test_check_length_refuses_long_sequences_for_every_position_kind():
    for position in ("rope", "learned"):
        config = base(position=position)
        config.check_length(16, "a prompt")
        with pytest.raises(
            ValueError, match=r"a prompt \(17 tokens\) exceeds Config.max_seq_len=16"
        ):
            config.check_length(17, "a prompt")
