"""Preference tuning: each loss and its gradient equal the paper's formula written out directly
(per-sequence forwards, log-softmax indexed by hand), DPO equals TRL's DPOTrainer on the same
batch, the reference is the model with its adapters off (no copy), the response mask covers the
last assistant turn alone, and train.py's --data-format preference runs, resumes from its cached
reference and refuses bad rows and flags."""

import json
import subprocess

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
import zoo
from cli.flags import default_chat_model as smollm2_gguf
from data.formats import detect_format
from data.packing import Example
from data.preference import PreferenceBatches, encode_pair, pair_rows, row_pair
from tests.reference.runner import ROOT, reference_python
from tests.training.conftest import write_checkpoint
from training.preference import (
    PreferenceLoss,
    PreferenceObjective,
    reference_logps,
    without_adapters,
)
from training.step import split_model

EOT = 0
EPS = float(np.finfo(np.float32).eps)
CONFIG = zoo.preset("tiny-llama", vocab_size=64, n_layers=2)
SEQ = 12
# (prompt ids, chosen response ids, rejected response ids): responses of unequal lengths.
PAIRS = [
    ([5, 9, 13], [21, 22, 23, 24], [30, 31]),
    ([7, 7], [40, 41, 42, 43, 44, 45], [46]),
    ([11, 12, 13, 14, 15], [3, 4], [50, 51, 52]),
]


def _pair_examples():
    return [
        tuple(Example([*p, *r], [False] * len(p) + [True] * len(r)) for r in (c, j))
        for p, c, j in PAIRS
    ]


def _data() -> PreferenceBatches:
    return PreferenceBatches.of(*pair_rows(_pair_examples(), SEQ, EOT), len(PAIRS), seed=0)


@pytest.fixture(scope="module")
def models():
    policy = zoo.Transformer(CONFIG, key=jax.random.key(1))
    reference = zoo.Transformer(CONFIG, key=jax.random.key(2))
    return policy, reference


def _direct_logp(model, prompt, response) -> jax.Array:
    """log pi(response | prompt): one unpadded forward of <eot> + prompt + response, the
    log-softmax indexed at each response token."""
    seq = [EOT, *prompt, *response]
    logprobs = jax.nn.log_softmax(model(jnp.asarray([seq]))[0].astype(jnp.float32))
    start = 1 + len(prompt)  # seq[k] is predicted by position k - 1
    return sum(logprobs[k - 1, seq[k]] for k in range(start, len(seq)))


def _sequence_logps(model) -> jax.Array:
    """`[pairs, 2]`: log pi(chosen | prompt) and log pi(rejected | prompt), pair by pair."""
    return jnp.stack(
        [jnp.stack([_direct_logp(model, p, c), _direct_logp(model, p, j)]) for p, c, j in PAIRS]
    )


def _paper_loss(loss: PreferenceLoss, logps: jax.Array, reference: jax.Array) -> jax.Array:
    """The papers' formulas on the per-sequence log-probs, pair by pair, then the mean."""
    beta, values = loss.beta, []
    for (_, chosen, rejected), (pc, pr), (rc, rr) in zip(PAIRS, logps, reference, strict=True):
        if loss.kind in ("dpo", "ipo"):
            h = (pc - rc) - (pr - rr)
            dpo, ipo = jnp.log1p(jnp.exp(-beta * h)), (h - 1 / (2 * beta)) ** 2
            value = dpo if loss.kind == "dpo" else ipo
        elif loss.kind == "simpo":
            x = beta * pc / len(chosen) - beta * pr / len(rejected) - loss.gamma
            value = jnp.log1p(jnp.exp(-x))
        else:  # orpo
            p_c, p_r = jnp.exp(pc / len(chosen)), jnp.exp(pr / len(rejected))
            odds = jnp.log(p_c / (1 - p_c)) - jnp.log(p_r / (1 - p_r))
            value = -pc / len(chosen) + beta * jnp.log1p(jnp.exp(-odds))
        values.append(value)
    return jnp.mean(jnp.stack(values))


@pytest.fixture(scope="module")
def paper_terms(models):
    """The policy's per-sequence log-probs and their Jacobian in the parameters, and the
    reference's log-probs: one compiled program, shared by every loss's formula (each loss is a
    function of these log-probs, so its gradient is the chain rule through the Jacobian)."""
    policy, reference = models
    params, static = split_model(policy)
    logps = jax.jit(lambda p: _sequence_logps(eqx.combine(p, static)))
    jacobian = jax.jit(jax.jacrev(lambda p: _sequence_logps(eqx.combine(p, static))))
    return logps(params), jacobian(params), jax.jit(_sequence_logps)(reference)


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo"])
def test_loss_and_gradient_equal_the_papers_formula(models, paper_terms, kind):
    policy, reference = models
    loss = PreferenceLoss(kind=kind)
    data = _data()
    if loss.needs_reference:
        data = data.with_reference(reference_logps(reference, data, len(PAIRS)))
    batch = jax.tree.map(jnp.asarray, data.in_order(1)[0])
    objective = PreferenceObjective(loss)
    params, static = split_model(policy)

    def ours(p):
        terms = objective.terms(eqx.combine(p, static), batch)
        return terms.nll_sum / objective.total(batch)

    value, grads = jax.jit(jax.value_and_grad(ours))(params)
    logps, jacobian, reference_values = paper_terms
    expected, outer = jax.value_and_grad(_paper_loss, argnums=1)(loss, logps, reference_values)
    expected_grads = jax.tree.map(lambda j: jnp.tensordot(outer, j, axes=2), jacobian)
    # Both sides run the same float32 ops on the same positions; they differ in the order of
    # sums (padded batched rows vs one unpadded row, a masked sum vs a Python sum over <= 6
    # tokens, the chain rule through the Jacobian vs one backward pass). Each summed log-prob
    # (|logp| <= ~30 here: 6 tokens of a 64-way softmax) carries a rounding error of about
    # eps * |logp| * (terms summed, <= 64 in a logsumexp); the losses scale it by beta <= 2.
    # Hence an absolute 64 * 30 * 2 * eps ~ 5e-4 bound on the loss; the gradient, a sum of such
    # terms, is held to the same bound relative to its largest entry.
    bound = 64 * 30 * 2 * EPS
    np.testing.assert_allclose(float(value), float(expected), rtol=0, atol=bound)
    flat, flat_expected = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
                           for t in (grads, expected_grads))  # fmt: skip
    scale = float(jnp.max(jnp.abs(flat_expected)))
    assert scale > 0
    np.testing.assert_allclose(np.asarray(flat), np.asarray(flat_expected), rtol=0,
                               atol=bound * scale)  # fmt: skip


def test_dpo_starts_at_log_2_and_its_gradient_prefers_the_chosen(models):
    """At the start (policy = reference) every DPO margin is 0 and the loss log 2; one gradient
    step raises the chosen log-prob relative to the rejected one."""
    policy, _ = models
    data = _data()
    data = data.with_reference(reference_logps(policy, data, len(PAIRS)))
    batch = jax.tree.map(jnp.asarray, data.in_order(1)[0])
    objective = PreferenceObjective(PreferenceLoss(kind="dpo", beta=0.5))
    params, static = split_model(policy)
    terms_of = eqx.filter_jit(objective.terms)
    terms = terms_of(policy, batch)
    np.testing.assert_allclose(float(terms.nll_sum) / len(PAIRS), np.log(2.0), atol=1e-6)
    nll = jax.jit(jax.grad(lambda p: objective.terms(eqx.combine(p, static), batch).nll_sum))
    grads = nll(params)
    stepped = eqx.combine(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), static)
    after = terms_of(stepped, batch)
    assert float(after.stats["margin"]) > 0
    assert float(after.nll_sum) < float(terms.nll_sum)


def test_the_reference_of_a_lora_model_is_its_base_without_a_copy(models):
    policy, _ = models
    lora = zoo.add_lora(policy, ["q_proj", "v_proj"], 4, 8, key=jax.random.key(5))
    # Non-zero B: the adapters change the function, so "off" is observable.
    params, static = split_model(lora)
    lora = eqx.combine(jax.tree.map(lambda b: b + 0.3, params), static)
    data = _data()
    off = without_adapters(lora)
    held = {id(x) for x in jax.tree.leaves(lora)}
    assert all(id(x) in held for x in jax.tree.leaves(off))  # the model's own arrays, no copy
    np.testing.assert_array_equal(
        reference_logps(lora, data, len(PAIRS)), reference_logps(policy, data, len(PAIRS))
    )
    adapted = jax.jit(lambda m, b: PreferenceObjective(PreferenceLoss()).terms(m, b))
    batch = jax.tree.map(jnp.asarray, data.in_order(1)[0])
    assert float(adapted(lora, batch).stats["margin"]) != 0.0


# --- TRL ---------------------------------------------------------------------------------


TRL_SCRIPT = """
import json, sys, torch, transformers
from datasets import Dataset
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference
job = json.load(open(sys.argv[1]))
load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_file=job["tokenizer"], eos_token="<|endoftext|>", pad_token="<|endoftext|>")
config = DPOConfig(output_dir=job["out"], beta=job["beta"], loss_type=["sigmoid"],
                   report_to="none", use_cpu=True, bf16=False,
                   per_device_train_batch_size=len(job["pairs"]))
unused = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
trainer = DPOTrainer(model=load(job["policy"]), ref_model=load(job["reference"]), args=config,
                     train_dataset=unused, processing_class=tokenizer)
batch = DataCollatorForPreference(pad_token_id=0)(job["pairs"])
with torch.no_grad():
    loss = trainer.compute_loss(trainer.model, batch)
json.dump({"loss": float(loss)}, open(job["out"] + "/trl.json", "w"))
"""


def test_dpo_equals_trl_dpo_trainer_on_the_same_batch(tmp_path, corpus):
    """TRL's DPOTrainer (sigmoid loss, explicit reference model, float32) on the same token ids:
    its prompt_ids are our <eot> + prompt, its completion ids our responses."""
    config = zoo.preset("tiny-llama", vocab_size=320, n_layers=2)
    base = write_checkpoint(tmp_path / "reference", corpus, config=config)
    reference = zoo.load_pretrained(base)
    params, static = split_model(reference)
    noise = jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.key(7), x.shape), params)
    policy = eqx.combine(jax.tree.map(jnp.add, params, noise), static)
    zoo.save_pretrained(policy, tmp_path / "policy")
    data = _data()
    data = data.with_reference(reference_logps(reference, data, len(PAIRS)))
    batch = jax.tree.map(jnp.asarray, data.in_order(1)[0])
    beta = 0.7
    objective = PreferenceObjective(PreferenceLoss(kind="dpo", beta=beta))
    terms = eqx.filter_jit(objective.terms)(policy, batch)  # one program, not op by op
    ours = float(terms.nll_sum) / len(PAIRS)
    job = {
        "policy": str(tmp_path / "policy"), "reference": str(base),
        "tokenizer": str(base / "tokenizer.json"), "beta": beta, "out": str(tmp_path),
        "pairs": [{"prompt_ids": [EOT, *p], "chosen_ids": c, "rejected_ids": r}
                  for p, c, r in PAIRS],
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "trl_dpo.py").write_text(TRL_SCRIPT)
    result = subprocess.run(
        [reference_python(), str(tmp_path / "trl_dpo.py"), str(tmp_path / "job.json")],
        capture_output=True, text=True, cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(
            f"TRL reference failed (install it: .venv-ref/bin/pip install trl):\n"
            f"{result.stderr[-3000:]}"
        )
    theirs = json.loads((tmp_path / "trl.json").read_text())["loss"]
    # Two float32 implementations (XLA vs torch; TRL's bf16 default is turned off): logits agree
    # to 1e-5 relative (the family tests' tolerance), so each of the four summed log-probs of a
    # pair (|logp| <= 40) to 4e-4; the margin, beta = 0.7 times their signed sum, to 1.1e-3,
    # and the loss, through a logistic of slope < 1, as well.
    assert abs(ours - theirs) < beta * 4 * 40 * 1e-5, (ours, theirs)
    assert abs(ours - np.log(2.0)) > 1e-2  # the policy differs from the reference


# --- data -------------------------------------------------------------------------------


ROLES = ("system", "user", "assistant")


def test_row_layouts_give_the_same_pair():
    strings = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}
    explicit = {
        "prompt": [{"role": "user", "content": "Hi?"}],
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    }
    implicit = {
        "chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
        "rejected": [
            {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Go away."},
        ],
    }
    pairs = [row_pair(row, 1, ROLES) for row in (strings, explicit, implicit)]
    assert pairs[0] == pairs[1] == pairs[2]
    assert detect_format(["prompt", "chosen", "rejected"], "auto") == "preference"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "row 3 has no 'rejected' response"),
        ({"prompt": "q", "chosen": None, "rejected": "b"}, "row 3 has no 'chosen' response"),
        (
            {"prompt": "q", "chosen": "same", "rejected": "same"},
            "row 3: 'chosen' and 'rejected' are the same response",
        ),
        ({"chosen": "a", "rejected": "b"}, "row 3: 'chosen' is a string but the row has no"),
        ({"prompt": "q", "chosen": 5, "rejected": "b"}, "row 3: 'chosen' is int 5, not a string"),
        (
            {
                "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
                "rejected": [
                    {"role": "user", "content": "y"},
                    {"role": "assistant", "content": "b"},
                ],
            },
            "row 3: 'chosen' and 'rejected' differ before their last assistant turn",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": [{"role": "user", "content": "a"}],
                "rejected": "b",
            },
            "row 3: the 'chosen' conversation ends with a 'user' turn",
        ),
    ],
)
def test_bad_rows_name_the_row(row, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        row_pair(row, 3, ROLES)


def test_the_response_mask_is_the_last_assistant_turn_on_smollm2():
    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    prompt = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    row = {"prompt": prompt, "chosen": "Rome.", "rejected": "Milan, I think."}
    chosen, rejected = encode_pair(tokenizer, *row_pair(row, 1, tokenizer_roles(tokenizer)))
    for side, text in ((chosen, "Rome."), (rejected, "Milan, I think.")):
        flagged = [t for t, a in zip(side.ids, side.answer, strict=True) if a]
        assert tokenizer.decode(flagged) == text + "<|im_end|>"
    n_prompt = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    assert chosen.ids[:n_prompt] == rejected.ids[:n_prompt]
    assert not any(chosen.answer[:n_prompt])


def tokenizer_roles(tokenizer):
    from data.supervised import roles

    return roles(tokenizer)


# --- train.py ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus):
    return write_checkpoint(tmp_path_factory.mktemp("pref_base"), corpus)


def _pairs_file(path, n=24, rows=None):
    rows = rows or [
        {"prompt": f"def f{i}(x):", "chosen": f" return x + {i}", "rejected": f" return x * {i}"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(out, data, checkpoint, *extra):
    return [
        "--init-from", str(checkpoint), "--data", str(data), "--out", str(out),
        "--seq-len", "24", "--batch-size", "4", "--steps", "4", "--warmup", "1", "--lr", "3e-2",
        "--log-every", "1", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every",
        "2", "--val-fraction", "0.2", "--no-progress", "--peak-flops", "1e11",
        "--peak-bandwidth", "1e10", *extra,
    ]  # fmt: skip


def test_a_lora_dpo_run_learns_and_resumes_from_its_cached_reference(tmp_path, checkpoint):
    data = _pairs_file(tmp_path / "prefs.jsonl")
    out = tmp_path / "run"
    lora = ("--lora-rank", "4", "--lora-alpha", "8")
    result = train.main(_argv(out, data, checkpoint, *lora))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "accuracy" in r)
    np.testing.assert_allclose(first["loss"], np.log(2.0), rtol=1e-5)  # policy = reference
    assert result.val_loss < result.initial_val_loss
    assert result.record["accuracy"] > first["accuracy"]
    cached = np.load(out / "reference.npy")
    # The cache equals the base's log-probs (adapters off), so a resume needs no reference pass.
    argv = ["--resume", str(out), "--steps", "6", "--no-progress", "--peak-flops", "1e11",
            "--peak-bandwidth", "1e10"]  # fmt: skip
    resumed = train.main(argv)
    assert resumed.step == 6
    np.testing.assert_array_equal(np.load(out / "reference.npy"), cached)


def test_bad_preference_flags_and_data(tmp_path, checkpoint, capsys):
    data = _pairs_file(tmp_path / "prefs.jsonl")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": "x = 1\n" * 20}) + "\n" for _ in range(10)))
    with pytest.raises(SystemExit):
        train.main(_argv(tmp_path / "a", data, checkpoint, "--beta", "0"))
    assert "argument --beta: must be a positive finite number, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--beta set a preference loss, but --data is text data"):
        train.main(_argv(tmp_path / "b", text, checkpoint, "--beta", "0.2"))
    with pytest.raises(ValueError, match="preference cannot be --streaming"):
        train.main(_argv(tmp_path / "c", data, checkpoint, "--streaming"))
    no_init = _argv(tmp_path / "d", data, checkpoint)[2:]
    with pytest.raises(ValueError, match="pass --init-from a checkpoint"):
        train.main(["--data-format", "preference", *no_init])
    rows = [{"prompt": "q", "chosen": "a b", "rejected": "c d"}] * 6
    rows.append({"prompt": "q", "chosen": "same", "rejected": "same"})
    bad = _pairs_file(tmp_path / "bad.jsonl", rows=rows)
    with pytest.raises(ValueError, match="row 7: 'chosen' and 'rejected' are the same response"):
        train.main(_argv(tmp_path / "e", bad, checkpoint, "--val-fraction", "0.5"))
    assert not (tmp_path / "e" / "checkpoints").exists()


def test_a_sharded_dpo_run_equals_one_device(tmp_path, checkpoint):
    """Pairs split over 8 data-parallel devices (the side and sequence dims whole): the same
    losses as on one device, to float32 summation order (1e-5 relative over 16 rows)."""
    data = _pairs_file(tmp_path / "prefs.jsonl", n=60)

    def losses(out, *extra):
        train.main(_argv(out, data, checkpoint, "--steps", "3", "--batch-size", "8", *extra))
        lines = (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
        return [r["loss"] for r in lines if "loss" in r]

    one = losses(tmp_path / "one")
    np.testing.assert_allclose(losses(tmp_path / "mesh", "--mesh", "data=8"), one, rtol=1e-5)
