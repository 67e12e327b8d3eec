"""zoo.load_tokenizer's chat templates: rendered text and token ids identical to transformers'
`apply_chat_template` (the SmolLM2 GGUF, the HF directory transformers saves from it, and two
more template families), the turn-ending ids, the sandbox, and an error for each bad input."""

import dataclasses
import datetime
import json
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zoo
from tests.reference.chat import CONVERSATIONS, TEXTS, chat_reference  # noqa: F401
from tests.reference.runner import smollm2_gguf
from zoo.tokenizer import bpe, chat

pytestmark = pytest.mark.xdist_group("smollm2")

DIRS = ("smollm2", "smollm2-unnamed", "llama3", "features")
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gguf_tokenizer() -> zoo.Tokenizer:
    return zoo.load_tokenizer(smollm2_gguf())


@pytest.fixture(scope="module")
def tokenizers(chat_reference, gguf_tokenizer) -> dict[str, zoo.Tokenizer]:  # noqa: F811
    loaded = {name: zoo.load_tokenizer(chat_reference[name]["dir"]) for name in DIRS}
    return {"gguf": gguf_tokenizer, **loaded}


@pytest.mark.parametrize("prompt", [False, True], ids=["no-prompt", "prompt"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", ["gguf", *DIRS])
def test_chat_matches_transformers(tokenizers, chat_reference, name, conversation, prompt):  # noqa: F811
    """ "gguf" is our reading of the GGUF file, compared with transformers' reading of it."""
    tokenizer = tokenizers[name]
    expected = chat_reference["smollm2" if name == "gguf" else name]["cases"]
    expected = expected[f"{conversation}-{prompt}"]
    messages = CONVERSATIONS[conversation]
    unknown = {m["role"] for m in messages} - set(chat.template_roles(tokenizer.chat_template))
    if "error" in expected:  # the template's raise_exception, in transformers and here
        refusal = expected["error"].removeprefix("TemplateError: ")
        with pytest.raises(ValueError, match=f"refuses these messages: {re.escape(refusal)}$"):
            tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
    elif unknown:  # transformers renders any role; we refuse the ones the template never names
        with pytest.raises(ValueError, match=f"has role {unknown.pop()!r}; this chat template"):
            tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
    else:
        assert tokenizer.render_chat(messages, add_generation_prompt=prompt) == expected["text"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
        assert ids == expected["ids"]


def test_the_reference_exercises_each_path(chat_reference):  # noqa: F811
    """Otherwise the test above could pass without comparing what it claims to."""
    features = chat_reference["features"]["cases"]
    assert "the system message must come first" in features["late-system-False"]["error"]
    assert '"output": "42"' in features["ipython-True"]["text"]  # a role beyond the four
    assert features["many-turns-False"]["text"].count("<|eot_id|>") == 6  # {% break %}
    assert "café" in features["system-False"]["text"]  # tojson keeps non-ASCII
    smollm2 = chat_reference["smollm2"]["cases"]["one-turn-True"]
    assert smollm2["text"].endswith("<|im_start|>assistant\n")
    assert chat_reference["smollm2"]["texts"] != chat_reference["smollm2-unnamed"]["texts"]


@pytest.mark.parametrize("name", DIRS)
def test_text_with_special_strings_matches_transformers(tokenizers, chat_reference, name):  # noqa: F811
    """Added and named special tokens become their ids; a chat marker that is neither
    ("smollm2-unnamed"'s <|im_start|>) stays text."""
    assert [tokenizers[name].encode(t) for t in TEXTS] == chat_reference[name]["texts"]


def test_end_of_turn_ids(tokenizers):
    gguf = tokenizers["gguf"]
    # ChatML: <|im_end|> ends a turn, and this GGUF also names it eos.
    assert gguf.end_of_turn_ids == (gguf.special_tokens["<|im_end|>"],) == (gguf.eos_token_id,)
    llama3 = tokenizers["llama3"]
    eot, eos = llama3.special_tokens["<|eot_id|>"], llama3.special_tokens["<|end_of_text|>"]
    assert llama3.eos_token_id == eos and llama3.eos_ids == (eos, eot)
    assert llama3.end_of_turn_ids == llama3.stop_ids() == (eot, eos)
    assert tokenizers["features"].end_of_turn_ids == (eot, eos)


def test_end_of_turn_without_a_template_is_eos(tmp_path, chat_reference):  # noqa: F811
    folder = chat_reference["llama3"]["dir"]
    bare = zoo.load_tokenizer(f"{folder}/tokenizer.json")
    assert bare.chat_template is None and bare.end_of_turn_ids == ()
    shutil.copy(f"{folder}/tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    assert zoo.load_tokenizer(tmp_path).end_of_turn_ids == (1,)


def test_chat_template_override(tmp_path, gguf_tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    as_text = zoo.load_tokenizer(smollm2_gguf(), chat_template=template)
    (tmp_path / "chat.jinja").write_text(template)
    for override in (
        as_text,
        zoo.load_tokenizer(smollm2_gguf(), chat_template=tmp_path / "chat.jinja"),
    ):
        assert override.render_chat(USER) == "[user] Hi<|im_end|>"
        assert override.apply_chat_template(USER)[-1] == gguf_tokenizer.eos_token_id
    assert gguf_tokenizer.chat_template != template  # replaced, not changed in place


def test_template_variables(tmp_path, tokenizers):
    features = tokenizers["features"]
    assert features.render_chat(USER, bos_token="<BOS>").startswith("<BOS><|start_header_id|>")
    with pytest.raises(ValueError, match="refuses these messages: this template takes no tools"):
        features.render_chat(USER, tools=[{"name": "f"}])
    template = "{{ strftime_now('%Y-%m-%d') }}"
    before = datetime.date.today().isoformat()
    rendered = zoo.load_tokenizer(smollm2_gguf(), chat_template=template).render_chat(USER)
    assert before <= rendered <= datetime.date.today().isoformat()


def test_gguf_text_matches_transformers(gguf_tokenizer, chat_reference):  # noqa: F811
    assert [gguf_tokenizer.encode(t) for t in TEXTS] == chat_reference["smollm2"]["texts"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=200))
def test_round_trip_any_unicode(gguf_tokenizer, text):
    """Exact, except for the bytes SmolLM2's vocabulary lacks, which HF drops too (the TEXTS above
    compare such text with transformers)."""
    vocab = gguf_tokenizer.backend.get_vocab()
    absent = bytes(b for b in range(256) if bpe.spell(bytes([b])) not in vocab)
    assert len(absent) == 21
    kept = text.encode().translate(None, absent).decode(errors="replace")
    assert gguf_tokenizer.decode(gguf_tokenizer.encode(text)) == kept


@pytest.mark.parametrize(
    ("messages", "error", "message"),
    [
        (
            [{"role": "robot", "content": "x"}],
            ValueError,
            "messages[0] has role 'robot'; this chat template takes the roles 'system', 'user', "
            "'assistant', 'tool'",
        ),
        ([{"role": "user"}], ValueError, "messages[0] (user) has no 'content'"),
        ([{"role": "user", "content": None}], ValueError, "messages[0] (user) has no 'content'"),
        ([{"role": "user", "content": 5}], TypeError, "content of type int; content must be"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            TypeError,
            "content of type list; content must be a string (multimodal",
        ),
        ([], ValueError, "messages is empty"),
        (
            [*USER, {"role": "assistant", "content": "x", "meta": object()}],
            TypeError,
            "messages[1]['meta'] is a object; a chat template only sees JSON values",
        ),
    ],
)
def test_bad_messages(gguf_tokenizer, messages, error, message):
    with pytest.raises(error, match=re.escape(message)):
        gguf_tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hi", "messages must be a list of dicts like [{'role': 'user', 'content': 'Hi!'}], not a"),
        ({"role": "user", "content": "hi"}, "messages must be a list of dicts like"),
        ([("user", "hi")], "messages[0] is a tuple, not a dict; messages must be a list of dicts"),
    ],
)
def test_messages_of_the_wrong_type(gguf_tokenizer, messages, message):
    """Called on the renderer: in the tests, beartype checks `apply_chat_template`'s annotation
    first; without it (as users run), these are the errors they get."""
    with pytest.raises(TypeError, match=re.escape(message)):
        chat.render(
            gguf_tokenizer.chat_template, messages, add_generation_prompt=False, variables={}
        )


def test_no_chat_template(chat_reference):  # noqa: F811
    bare = zoo.load_tokenizer(f"{chat_reference['llama3']['dir']}/tokenizer.json")
    message = "tokenizer.json has no chat template .*chat_template='file.jinja'"
    with pytest.raises(ValueError, match=message):
        bare.apply_chat_template(USER)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_hidden=1) %}",
        "{{ dict.__class__.__subclasses__() }}",
    ],
)
def test_sandbox_refuses_python_internals(gguf_tokenizer, template):
    tokenizer = dataclasses.replace(gguf_tokenizer, chat_template=template)
    with pytest.raises(ValueError, match="tried to reach Python internals, which the sandbox"):
        tokenizer.apply_chat_template(USER)


def test_template_errors(tmp_path):
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1: .*\); fix it"):
        zoo.load_tokenizer(smollm2_gguf(), chat_template="{% for m in messages %}")
    reads = zoo.load_tokenizer(smollm2_gguf(), chat_template="{{ messages[0].name.first }}")
    with pytest.raises(ValueError, match="reads something these messages do not have"):
        reads.apply_chat_template(USER)


def test_unreadable_template_files(tmp_path):
    (tmp_path / "latin1.jinja").write_bytes(b"{{ caf\xe9 }}")
    (tmp_path / "empty.jinja").write_text("\n")
    missing = tmp_path / "missing.jinja"
    for path in (missing, str(missing), tmp_path, tmp_path / "latin1.jinja"):
        with pytest.raises(ValueError, match=r"cannot read the chat template file .*; pass a"):
            zoo.load_tokenizer(smollm2_gguf(), chat_template=path)
    with pytest.raises(ValueError, match=r"empty\.jinja' is empty"):
        zoo.load_tokenizer(smollm2_gguf(), chat_template=tmp_path / "empty.jinja")


def test_named_templates_without_default(tmp_path, chat_reference):  # noqa: F811
    shutil.copy(f"{chat_reference['llama3']['dir']}/tokenizer.json", tmp_path)
    templates = [{"name": "tool_use", "template": "{{ 1 }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    with pytest.raises(ValueError, match=r"lists templates \['tool_use'\] but no 'default'"):
        zoo.load_tokenizer(tmp_path)


def test_decode_refuses_ids_outside_the_vocabulary(gguf_tokenizer):
    with pytest.raises(ValueError, match=r"token ids \[49152\] are outside the vocabulary"):
        gguf_tokenizer.decode([1, 49152])
