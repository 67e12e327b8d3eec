"""A user's first day, with tiny models: checkpoints of Gemma 2, Gemma 3, Mistral and Phi-3 as
transformers saves them (models and tokenizers) load and generate with every default, their
tokenizer ids and greedy replies equal to transformers'; and the loop `eqx-zoo finetune` ->
`chat --model RUN` -> `merge` -> transformers' AutoModelForCausalLM + AutoTokenizer closes, the
merged directory giving transformers the replies our chat gave (README: "A first day")."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from cli.chat import main as chat
from cli.export import merge
from cli.sample import main as sample
from cli.train import finetune
from tests.reference.first_day import (
    CONVERSATION,
    MODELS,
    NEW_TOKENS,
    TEXTS,
    export_reference,
    first_day_reference,  # noqa: F401
)

pytestmark = pytest.mark.xdist_group("first-day")
ASK = ["--system", CONVERSATION[0]["content"], "--message", CONVERSATION[1]["content"]]


def until_stop(tokens: list[int], stops) -> list[int]:
    """`tokens` up to and including the first stop id (where our reply ends)."""
    ends = [i for i, t in enumerate(tokens) if t in stops]
    return tokens[: ends[0] + 1] if ends else tokens


@pytest.mark.parametrize("name", [m["name"] for m in MODELS])
def test_a_checkpoint_loads_and_chats_with_every_default(first_day_reference, name):  # noqa: F811
    reference = first_day_reference[name]
    tokenizer = zoo.load_tokenizer(reference["path"])
    assert [tokenizer.encode(text) for text in TEXTS] == reference["texts"]
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt == reference["chat"]
    (reply,) = chat(["--model", reference["path"], *ASK, "--max-new-tokens", str(NEW_TOKENS)])
    # Greedy on both sides; ours also stops at the template's end of turn.
    assert reply.request.tokens == until_stop(reference["greedy"], tokenizer.stop_ids())


def test_sample_runs_a_gemma2_with_every_default(first_day_reference):  # noqa: F811
    """No kernel chosen: the default serves soft-capping (xla cannot), any prompt length."""
    model = zoo.load_pretrained(first_day_reference["gemma2"]["path"])
    assert model.policy.kernel_name != "xla"
    reply = sample(["--model", first_day_reference["gemma2"]["path"], "--prompt", TEXTS[2]])
    assert reply.stopped_by in ("stop token", "length") and reply.request.tokens


@pytest.fixture(scope="module")
def walkthrough(first_day_reference, tmp_path_factory):  # noqa: F811
    """finetune (LoRA, on a tiny Mistral checkpoint, two steps of the example chat data) ->
    chat with the run -> merge it -> chat with the merged directory."""
    out = tmp_path_factory.mktemp("walkthrough")
    base = first_day_reference["mistral"]["path"]
    result = finetune(["--model", base, "--out", str(out / "run"), "--steps", "2", "--warmup", "1",
                       "--batch-size", "4", "--seq-len", "256", "--truncate", "--eval-every", "2",
                       "--log-every", "1", "--checkpoint-every", "2", "--no-progress"])  # fmt: skip
    asked = [*ASK, "--max-new-tokens", str(NEW_TOKENS)]
    (from_run,) = chat(["--model", str(out / "run"), *asked])
    merged = merge(["--model", str(out / "run"), "--out", str(out / "merged")])
    (from_merged,) = chat(["--model", str(merged), *asked])
    reference = export_reference([merged], out / "reference")[str(merged)]
    return result, from_run, from_merged, merged, reference


def test_finetune_writes_a_lora_run_and_its_peft_adapter(walkthrough):
    result, *_ = walkthrough
    assert (result.run_dir / "adapter" / "adapter_config.json").is_file()
    assert result.initial_val_loss is not None and result.val_loss is not None
    record = json.loads((result.run_dir / "run.json").read_text())
    assert record["settings"]["lora_rank"] == 8 and record["settings"]["steps"] == 2


def test_chat_with_the_run_and_with_its_merged_export_agree(walkthrough):
    _, from_run, from_merged, *_ = walkthrough
    assert from_run.request.tokens == from_merged.request.tokens
    assert from_run.text == from_merged.text


def test_the_merged_directory_is_complete_and_transformers_gives_the_same_reply(walkthrough):
    result, from_run, _, merged, reference = walkthrough
    files = {p.name for p in merged.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files  # fmt: skip
    assert json.loads((merged / "tokenizer_config.json").read_text())["chat_template"]
    tokenizer = zoo.load_tokenizer(merged)
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt == reference["chat"]  # AutoTokenizer: the same ids and template
    assert [tokenizer.encode(text) for text in TEXTS] == reference["texts"]
    # generation_config.json's stop ids are the tokenizer's: transformers stops where we do.
    assert set(np.atleast_1d(reference["eos"])) == set(tokenizer.stop_ids())
    assert from_run.request.tokens == until_stop(reference["greedy"], tokenizer.stop_ids())
    # The merged weights give transformers the logits of the LoRA run (float32: a merge and two
    # frameworks' summation orders, ~1e-6 relative).
    ours = result.model(jnp.asarray([prompt]))[0, -1]
    np.testing.assert_allclose(ours, reference["logits"], rtol=1e-4, atol=1e-4)
