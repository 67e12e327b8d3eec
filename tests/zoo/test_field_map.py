"""Which Config fields each HF layout holds, in one place (zoo/pretrained/field_map.py): a
config is written in a family's layout only if every other field is at its default, so a field
added to the Config is exported by no family until one says it holds it, never silently as a
Llama's."""

import dataclasses

import pytest

import zoo
from zoo.config import Config
from zoo.pretrained.architectures import ARCHITECTURES, architecture_for
from zoo.pretrained.field_map import HELD, off_default

LLAMA = zoo.preset("tiny-llama")


def test_every_config_field_is_held_by_some_layout():
    """A new Config field fails this test until a family says it holds it (its module's
    `HOLDS`): until then no model using it can be exported (the test below)."""
    held = HELD | set().union(*(a.holds for a in ARCHITECTURES.values()))
    no_layout = {f.name for f in dataclasses.fields(Config)} - held
    assert no_layout == set(), f"no HF layout holds {sorted(no_layout)}"


@pytest.mark.parametrize(
    ("change", "family"),
    [({}, "LlamaForCausalLM"), ({"qk_norm": True}, "Qwen3ForCausalLM"),
     ({"qkv_bias": True}, "Qwen2ForCausalLM"), ({"sliding_window": 4}, "MistralForCausalLM")],
)  # fmt: skip
def test_a_field_goes_to_the_first_layout_that_holds_it(change, family):
    assert architecture_for(LLAMA.replace(**change)).name == family


def test_a_field_no_layout_holds_is_refused_not_exported_as_a_llama(monkeypatch):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NewConfig(Config):  # the Config with a field added tomorrow
        new_feature: bool = False

    monkeypatch.setitem(zoo.config._FIELD_TYPES, "new_feature", bool)  # the Config's type check
    plain = NewConfig(**{f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(Config)})
    assert architecture_for(plain).name == "LlamaForCausalLM"  # at its default: nothing lost
    featured = dataclasses.replace(plain, new_feature=True)
    assert off_default(featured, ARCHITECTURES["LlamaForCausalLM"].holds) == ["new_feature"]
    with pytest.raises(ValueError, match=r"no layout holds the Config fields \['new_feature'\]"):
        architecture_for(featured)
    with pytest.raises(ValueError, match=r"has no place for \['new_feature'\]"):
        architecture_for(featured, "LlamaForCausalLM")
