"""generate: greedy == a naive loop over the full forward; ragged rows == each prompt alone;
stop tokens, streaming, seeded sampling."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import infer
from infer.generation import SPAN
from tests.reference.word_tokenizer import word_tokenizer


@eqx.filter_jit
def last_logits(model, tokens, length):
    return model(tokens)[0, length - 1]


def naive_greedy(model, prompt, n, width=16):
    """Re-run the whole forward pass for every new token (the specification). Tokens are
    right-padded to a fixed width so it compiles once; causal attention ignores the padding."""
    tokens = list(prompt)
    for _ in range(n):
        padded = jnp.array([tokens + [0] * (width - len(tokens))])
        tokens.append(int(jnp.argmax(last_logits(model, padded, jnp.int32(len(tokens))))))
    return tokens[len(prompt) :]


PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8]]


def test_ragged_greedy_batch_equals_naive_loop_per_prompt(model):
    out = infer.generate(
        model, PROMPTS, max_new_tokens=6, sampler=infer.Greedy(), key=jax.random.key(0)
    )
    assert out == [naive_greedy(model, p, 6) for p in PROMPTS]


def test_stop_token_ends_a_row_and_all_rows_stop_early(model):
    full = infer.generate(
        model, PROMPTS[:2], max_new_tokens=6, sampler=infer.Greedy(), key=jax.random.key(0)
    )
    stop = full[0][2]
    out = infer.generate(
        model,
        PROMPTS[:2],
        max_new_tokens=6,
        sampler=infer.Greedy(),
        key=jax.random.key(0),
        stop_tokens=(stop,),
    )
    assert out[0] == full[0][:3]
    first_stop = full[1].index(stop) + 1 if stop in full[1] else 6
    assert out[1] == full[1][:first_stop]
    # Both rows stopping ends the loop: every row stops at the same token here.
    both = infer.generate(
        model,
        [PROMPTS[0], PROMPTS[0]],
        max_new_tokens=6,
        sampler=infer.Greedy(),
        key=jax.random.key(0),
        stop_tokens=(full[0][0],),
    )
    assert both == [full[0][:1], full[0][:1]]


def test_streamed_chunks_add_up_to_the_result(model):
    chunks = []
    out = infer.generate(
        model,
        PROMPTS[:2],
        max_new_tokens=7,
        sampler=infer.Greedy(),
        key=jax.random.key(0),
        on_tokens=chunks.append,
        chunk_size=3,
    )
    # Called once every row has a token, then each time the slowest has 3 more: row 1 (its
    # prompt computed in the step after row 0's, the engine's budget taking the oldest first).
    assert [len(c[1]) for c in chunks] == [1, 3, 3]
    streamed = [[t for c in chunks for t in c[row]] for row in range(2)]
    assert streamed == out


def test_sampling_is_seeded(model):
    sampler = infer.TopK(k=20, temperature=1.0)

    def run(seed):
        return infer.generate(
            model, PROMPTS[:2], max_new_tokens=8, sampler=sampler, key=jax.random.key(seed)
        )

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    np.testing.assert_array_less(np.array(first), model.config.vocab_size)


def test_the_tokenizers_stop_ids_are_the_default_and_an_empty_tuple_turns_them_off(model):
    """Given its tokenizer, generation stops where the model says stop (eos) unless told not to;
    an engine made with stop tokens applies them to every request that names none."""

    def run(**settings):  # two prompts: the engine the test above compiled serves them
        greedy = {"max_new_tokens": 6, "sampler": infer.Greedy(), "key": jax.random.key(0)}
        return infer.generate(model, PROMPTS[:2], **greedy, **settings)[0]

    full = run()
    tokenizer = word_tokenizer(model.config.vocab_size, eos=full[2])
    assert tokenizer.stop_ids() == (full[2],)
    assert run(tokenizer=tokenizer) == full[: full.index(full[2]) + 1]
    assert run(tokenizer=tokenizer, stop_tokens=()) == full

    # The engine `generate` made for those prompts, so its programs are compiled already.
    span = min(SPAN, model.config.max_seq_len)
    engine = infer.Engine(model, max_batch=2, max_len=span, stop_tokens=tokenizer.stop_ids())
    default, unstopped = (
        engine.submit(PROMPTS[0], max_new_tokens=6),
        engine.submit(PROMPTS[0], max_new_tokens=6, stop_tokens=()),
    )
    engine.run()
    assert (default.tokens, unstopped.tokens) == (full[: full.index(full[2]) + 1], full)
