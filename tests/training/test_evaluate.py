"""Evaluation: perplexity equals exp(mean token NLL) computed independently (one plain forward per
window, log-softmax indexed by hand), bits per byte from the same sum; multiple choice picks what
per-choice forwards pick; generation through the engine scores exact match and a checker; the
command line writes JSON and a table for a checkpoint, a run directory and an adapter; the
lm-eval adapter runs a local harness task end to end; bad task files name the line."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from tests.training.conftest import write_checkpoint
from training import evaluate, scoring
from training.lm_eval_adapter import run_lm_eval
from zoo.adapter import split_trainable

CONFIG = zoo.preset("tiny-llama", vocab_size=320, n_layers=2, max_seq_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus):
    return write_checkpoint(tmp_path_factory.mktemp("eval_ckpt"), corpus, config=CONFIG)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return evaluate.load_model(str(checkpoint))


# One compiled forward for every length: op-by-op forwards of a new length each compile every op.
_log_softmax = eqx.filter_jit(
    lambda model, tokens: jax.nn.log_softmax(model(tokens)[0].astype(jnp.float32))
)


def _log_probs(model, ids: list[int]):
    """`[len(ids), vocab]`: one plain forward's log-probabilities at each of `ids`, the row
    right-padded to the model's max_seq_len (under the causal mask padding changes no earlier
    position)."""
    padded = ids + [0] * (model.config.max_seq_len - len(ids))
    return _log_softmax(model, jnp.asarray([padded]))[: len(ids)]


def _direct_nll(model, ids: list[int], eot: int, window: int) -> tuple[float, int]:
    """Summed NLL of every id of a document: <eot> + ids in windows of `window` predicted tokens,
    each window a separate forward starting one token before it."""
    full, total, count = [eot, *ids], 0.0, 0
    for start in range(1, len(full), window):
        piece = full[start - 1 : start + window]
        logprobs = _log_probs(model, piece[:-1])
        for k in range(1, len(piece)):
            total -= float(logprobs[k - 1, piece[k]])
            count += 1
    return total, count


def test_perplexity_is_exp_of_the_mean_token_nll(loaded):
    model, tokenizer = loaded
    encoding = tokenizer  # tiktoken's names (encode_ordinary, eot_token) on zoo.Tokenizer
    texts = ["def add(a, b):\n    return a + b\n", "import os\n" * 30, "x = [1, 2, 3]"]
    window = CONFIG.max_seq_len
    result = scoring.perplexity(model, encoding, texts, window=window, batch_size=4)
    total, count = 0.0, 0
    for text in texts:
        nll, n = _direct_nll(model, encoding.encode_ordinary(text), encoding.eot_token, window)
        total, count = total + nll, count + n
    assert result.tokens == count
    assert count > window  # one document spans two windows
    # float32 sums of ~100 NLLs of ~6 nats: the two orders agree to ~100 * 6 * eps relative.
    np.testing.assert_allclose(result.nll, total, rtol=1e-4)
    np.testing.assert_allclose(result.perplexity, math.exp(total / count), rtol=1e-4)
    n_bytes = sum(len(t.encode()) for t in texts)
    np.testing.assert_allclose(result.bits_per_byte, total / math.log(2) / n_bytes, rtol=1e-4)


def test_scoring_compiles_once_per_bucket(loaded):
    model, tokenizer = loaded
    encoding = tokenizer  # tiktoken's names (encode_ordinary, eot_token) on zoo.Tokenizer
    scoring.perplexity(model, encoding, ["a = 1\n" * 3], batch_size=4)
    before = sum(scoring.SCORE_TRACES.values())
    scoring.perplexity(model, encoding, ["b = 2\n" * 5, "c"], batch_size=4)  # other lengths
    assert sum(scoring.SCORE_TRACES.values()) == before


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_multiple_choice_picks_what_per_choice_forwards_pick(loaded, tmp_path):
    model, tokenizer = loaded
    encoding = tokenizer  # tiktoken's names (encode_ordinary, eot_token) on zoo.Tokenizer
    rows = [
        {"prompt": "def f(x):", "choices": [" return x", " pass", " yield"], "answer": 0},
        {"prompt": "import", "choices": [" os", " sys"], "answer": 1},
        {"prompt": "for i in", "choices": [" range(3):", " x:", " []:"], "label": 2},
    ]
    path = _jsonl(tmp_path / "mc.jsonl", rows)
    result = evaluate.choice_task(model, tokenizer, path, batch_size=4)
    hits = hits_norm = 0
    for row in rows:
        context = [encoding.eot_token, *encoding.encode_ordinary(row["prompt"])]
        logps = []
        for choice in row["choices"]:
            ids = encoding.encode_ordinary(choice)
            logprobs = _log_probs(model, context + ids)
            logps.append(sum(float(logprobs[len(context) - 1 + j, t]) for j, t in enumerate(ids)))
        answer = row.get("answer", row.get("label"))
        lengths = [len(c.encode()) for c in row["choices"]]
        hits += int(np.argmax(logps) == answer)
        hits_norm += int(np.argmax(np.array(logps) / lengths) == answer)
    assert result["accuracy"] == hits / 3
    assert result["accuracy_norm"] == hits_norm / 3


def test_generation_scores_exact_match_and_a_checker(loaded, tmp_path):
    model, tokenizer = loaded
    encoding = tokenizer  # tiktoken's names (encode_ordinary, eot_token) on zoo.Tokenizer
    prompts = ["def f(", "import ", "class A", "x = "]
    ids = [[encoding.eot_token, *encoding.encode_ordinary(p)] for p in prompts]
    greedy = infer.generate(model, ids, max_new_tokens=6, sampler=infer.Greedy(),
                            key=jax.random.key(0), stop_tokens=[encoding.eot_token])  # fmt: skip
    texts = [encoding.decode([t for t in g if t != encoding.eot_token]) for g in greedy]
    # Half the answers are what greedy decoding gives, half are not: accuracy 0.5 exactly.
    rows = [{"prompt": p, "answer": t if i % 2 == 0 else t + "never"}
            for i, (p, t) in enumerate(zip(prompts, texts, strict=True))]  # fmt: skip
    path = _jsonl(tmp_path / "gen.jsonl", rows)
    settings = {"max_new_tokens": 6, "batch_size": 2, "chat": False}
    result = evaluate.generate_task(model, tokenizer, path, **settings)
    assert result["accuracy"] == 0.5
    assert [s["completion"] for s in result["samples"]] == texts
    checks = tmp_path / "checks.py"
    checks.write_text(
        "def starts(completion, row):\n    return completion.startswith(row['answer'][:2])\n"
        "def broken(completion, row):\n    raise KeyError('nope')\n"
        "def too_big(completion, row):\n    return 2.0\n"
    )
    scored = evaluate.generate_task(
        model, tokenizer, path, checker=evaluate.load_checker(f"{checks}:starts"), **settings
    )
    assert scored["accuracy"] == 1.0
    with pytest.raises(ValueError, match=r"gen.jsonl: line 1: the checker raised KeyError"):
        evaluate.generate_task(
            model, tokenizer, path, checker=evaluate.load_checker(f"{checks}:broken"), **settings
        )
    with pytest.raises(ValueError, match=r"line 1: the checker returned 2.0, not a bool or a"):
        evaluate.generate_task(
            model, tokenizer, path, checker=evaluate.load_checker(f"{checks}:too_big"), **settings
        )
    with pytest.raises(ValueError, match=r"has no function 'missing'"):
        evaluate.load_checker(f"{checks}:missing")


@pytest.mark.parametrize(
    ("rows", "kind", "message"),
    [
        ([{"prompt": "a", "answer": 0}], "choice", r"line 1: 'choices' is None, not a list"),
        ([{"prompt": "a", "choices": ["x", "y"], "answer": 2}], "choice",
         r"line 1: 'answer' 2 is not an index into its 2 choices"),
        ([{"prompt": "a", "choices": ["x"], "answer": 0}], "choice", "two or more non-empty"),
        ([{"prompt": "a", "choices": ["x", "y"], "answer": "x"}], "choice",
         r"'answer' is 'x', not an integer index"),
        ([{"prompt": "a"}, {"prompt": "b"}], "generate", r"line 1 has no 'answer'"),
        ([{"question": "a", "answer": "b"}], "generate", r"'prompt' is None, not a string"),
    ],
)  # fmt: skip
def test_bad_task_files_name_the_line(loaded, tmp_path, rows, kind, message):
    model, tokenizer = loaded
    path = _jsonl(tmp_path / "task.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        evaluate.evaluate(model, tokenizer, [(kind, str(path))], chat=False)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2 is list, not an object"):
        evaluate.read_rows(tmp_path / "broken.jsonl")


def test_the_command_line_on_a_checkpoint_a_run_and_an_adapter(checkpoint, loaded, tmp_path,
                                                               capsys):  # fmt: skip
    model, _ = loaded
    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": "def f(x):\n    return x\n"}] * 3)
    mc = _jsonl(tmp_path / "mc.jsonl", [{"prompt": "a", "choices": [" b", " c"], "answer": 0}])
    out = tmp_path / "results.json"
    argv = ["--task", f"perplexity={texts}", "--task", f"choice={mc}", "--out", str(out)]
    results = evaluate.main([str(checkpoint), *argv])
    printed = capsys.readouterr().out
    assert f"| perplexity:{texts} | perplexity |" in printed
    saved = json.loads(out.read_text())["results"]
    assert saved[f"choice:{mc}"]["n"] == 1
    assert saved == json.loads(json.dumps(results))
    # An adapter with non-zero B changes the perplexity; folded in, it is what the adapted
    # model scores.
    adapted = zoo.add_lora(model, ["q_proj", "v_proj"], 2, 4, key=jax.random.key(1))
    params, static = split_trainable(adapted)
    adapted = eqx.combine(jax.tree.map(lambda x: x + 0.05, params), static)
    zoo.save_adapter(adapted, tmp_path / "adapter")
    with_adapter = evaluate.main([str(checkpoint), "--adapter", str(tmp_path / "adapter"),
                                  "--task", f"perplexity={texts}"])  # fmt: skip
    base_ppl = results[f"perplexity:{texts}"]["perplexity"]
    assert with_adapter[f"perplexity:{texts}"]["perplexity"] != pytest.approx(base_ppl)
    with pytest.raises(SystemExit):
        evaluate.main([str(checkpoint), "--task", "nonsense=x.jsonl"])
    assert "is not KIND=FILE" in capsys.readouterr().err


def test_a_run_directory_evaluates(tmp_path, tiny_argv):
    import train

    result = train.main(tiny_argv(tmp_path / "run", "--steps", "2"))
    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": "def f(x):\n    return x\n"}] * 2)
    results = evaluate.main([str(tmp_path / "run"), "--task", f"perplexity={texts}"])
    model, encoding = result.model, result.encoding
    expected = scoring.perplexity(model, encoding, ["def f(x):\n    return x\n"] * 2)
    np.testing.assert_allclose(
        results[f"perplexity:{texts}"]["perplexity"], expected.perplexity, rtol=1e-6
    )


LOCAL_TASK = """
task: zoo_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

LOCAL_GENERATE = """
task: zoo_local_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_runs_local_tasks_end_to_end(loaded, tmp_path):
    """The harness's own task machinery (YAML, datasets, metrics) over our adapter: its
    multiple-choice accuracy equals the choice task's on the same rows; its generate_until
    exact match equals ours with the harness's stop string."""
    model, tokenizer = loaded
    rows = [
        {"prompt": "def f(x):", "choices": [" return x", " pass"], "answer": 0},
        {"prompt": "import", "choices": [" os", " sys"], "answer": 1},
        {"prompt": "while", "choices": [" True:", " x"], "answer": 0},
    ]
    mc = _jsonl(tmp_path / "mc.jsonl", rows)
    encoding = tokenizer  # tiktoken's names (encode_ordinary, eot_token) on zoo.Tokenizer
    prompts = ["def f(", "import "]
    ids = [[encoding.eot_token, *encoding.encode_ordinary(p)] for p in prompts]
    greedy = infer.generate(model, ids, max_new_tokens=5, sampler=infer.Greedy(),
                            key=jax.random.key(0), stop_tokens=[encoding.eot_token])  # fmt: skip
    firsts = [encoding.decode(g).split("\n")[0] for g in greedy]
    gen = _jsonl(tmp_path / "gen.jsonl", [{"prompt": prompts[0], "answer": firsts[0]},
                                          {"prompt": prompts[1], "answer": "wrong"}])  # fmt: skip
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "choice.yaml").write_text(LOCAL_TASK.format(data=mc))
    (tasks / "generate.yaml").write_text(LOCAL_GENERATE.format(data=gen))
    results = run_lm_eval(model, tokenizer, ["zoo_local_choice", "zoo_local_generate"],
                          include=str(tasks), batch_size=4)  # fmt: skip
    ours = evaluate.choice_task(model, tokenizer, mc)
    assert results["lm-eval:zoo_local_choice"]["acc"] == ours["accuracy"]
    assert results["lm-eval:zoo_local_generate"]["exact_match"] == 0.5


def test_eqx_zoo_evaluate_is_the_same_evaluation_with_the_shared_flags(
    checkpoint, tmp_path, capsys
):
    """`eqx-zoo evaluate --model X` (any artifact, the CLI's flags) scores what `python -m
    training.evaluate X` scores; a preset has no tokenizer to score text with; numbers are
    checked at their flag."""
    from cli.evaluate import main as eqx_zoo_evaluate

    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": "def f(x):\n    return x\n"}] * 2)
    mc = _jsonl(tmp_path / "mc.jsonl", [{"prompt": "import", "choices": [" os", " x"],
                                        "answer": 0}])  # fmt: skip
    tasks = ["--task", f"perplexity={texts}", "--task", f"choice={mc}"]
    ours = eqx_zoo_evaluate(["--model", str(checkpoint), *tasks, "--out", str(tmp_path / "r")])
    theirs = evaluate.main([str(checkpoint), *tasks])
    saved = json.loads((tmp_path / "r").read_text())["results"]
    for results in (ours, theirs, saved):
        for metrics in results.values():
            metrics.pop("seconds")
    assert ours == theirs == saved
    with pytest.raises(ValueError, match="model 'tiny-llama' comes with no tokenizer"):
        eqx_zoo_evaluate(["--model", "tiny-llama", *tasks])
    for flag, value, message in [("--temperature", "nan", "a non-negative finite number"),
                                 ("--batch-size", "0", "a positive integer")]:  # fmt: skip
        with pytest.raises(SystemExit):
            eqx_zoo_evaluate(["--model", str(checkpoint), *tasks, flag, value])
        assert f"eqx-zoo evaluate: error: argument {flag}: must be {message}" in (
            capsys.readouterr().err
        )
