"""A tiny local corpus and tiny train.py settings shared by the training tests."""

import json
import shutil
import sysconfig
from pathlib import Path

import jax
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import zoo
from training.run_dir import checkpoints as run_dir_checkpoints


def write_corpus(path: Path, n_docs: int = 24, chars: int = 1500) -> Path:
    """The first `chars` characters of `n_docs` small stdlib files, as JSON lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > chars)[:n_docs]
    with path.open("w") as f:
        for file in files:
            f.write(json.dumps({"text": file.read_text(encoding="utf-8")[:chars]}) + "\n")
    return path


TINY_LLAMA = zoo.preset("tiny-llama", vocab_size=320, n_layers=1)


def write_checkpoint(directory: Path, corpus: Path, config=TINY_LLAMA, dtype="float32") -> Path:
    """A tiny zoo model written with save_pretrained, beside a byte-level BPE tokenizer.json
    trained on `corpus`: a pretrained checkpoint for --init-from."""
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    model = zoo.Transformer(config, policy=zoo.Policy.of_dtype(dtype), key=jax.random.key(3))
    zoo.save_pretrained(model, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def make_argv(corpus: Path, cache_dir: Path):
    """argv for train.main: a 2-layer Llama (or the checkpoint `init_from`) on the tiny corpus, a
    few steps, no measurement."""

    def argv(
        out: Path, *extra: str, data: Path | None = None, init_from: Path | None = None
    ) -> list[str]:
        model = ["--model", "tiny-llama", "--override", "vocab_size=320"]
        return [
            *(["--init-from", str(init_from)] if init_from else model), "--vocab-size", "300",
            "--data", str(data or corpus), "--seq-len", "16", "--batch-size", "4",
            "--steps", "4", "--warmup", "1", "--lr", "1e-2", "--log-every", "1",
            "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "2",
            "--cache-dir", str(cache_dir), "--out", str(out), "--no-progress",
            "--peak-flops", "1e11", "--peak-bandwidth", "1e10", *extra,
        ]  # fmt: skip

    return argv


def stopped_copy(run_dir: Path, out: Path, step: int) -> Path:
    """`run_dir` as it was when its run stopped after the checkpoint of `step` (later
    checkpoints and metrics dropped): what a killed run leaves to --resume."""
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns(".lock"))
    for checkpoint in run_dir_checkpoints(out):  # finalized ones; orbax clears its temporaries
        if int(checkpoint.name.removeprefix("step_")) > step:
            shutil.rmtree(checkpoint)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    return out


@pytest.fixture
def tiny_argv(corpus, cache_dir):
    return make_argv(corpus, cache_dir)


@pytest.fixture(scope="session")
def full_run(corpus, cache_dir, tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, summary) of one uninterrupted 6-step one-device run with checkpoints at
    steps 3 and 6: the reference for the resume and --mesh tests."""
    import train

    out = tmp_path_factory.mktemp("full")
    argv = make_argv(corpus, cache_dir)(out, "--steps", "6", "--checkpoint-every", "3")
    return out, train.main(argv)
