"""The command table of `eqx-zoo`: one entry per subcommand (its name, what it does, how long it
takes, and the functions that build its parser and run it). Adding a subcommand is one entry
here and the module it names. Nothing heavy is imported here: the table is read by `--help`."""

import argparse
import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Command:
    """`main` and `parser` are "module:function": `main(argv, prog)` runs the command,
    `parser(prog)` is its argparse parser (for --help and the flag-vocabulary test).
    `own_defaults`: the shared flags whose default this command sets itself (its --help shows
    them); every other flag has the vocabulary's one default (tests/cli/test_vocabulary.py).
    `own_kinds`: the shared flags that take another kind of value here (its --help says
    which); every other shared flag accepts the same values in every command."""

    name: str
    summary: str
    duration: str
    main: str
    parser: str
    own_defaults: tuple[str, ...] = ()
    own_kinds: tuple[str, ...] = ()

    def _load(self, target: str):
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)

    def run(self, argv: list[str]):
        return self._load(self.main)(argv, prog=f"eqx-zoo {self.name}")

    def build_parser(self):
        return self._load(self.parser)(prog=f"eqx-zoo {self.name}")


COMMANDS = (
    Command(
        "train",
        "train a model from scratch or fine-tune one (train.py's flags; `python train.py` too)",
        "about 3 min for the default gpt-mini run on a 2-core CPU; scales with --steps",
        "cli.train:train",
        "cli.train:train_parser",
    ),
    Command(
        "finetune",
        "LoRA-tune a chat model on chat data: train with fine-tuning defaults (SmolLM2-135M-"
        "Instruct on examples/data/chat.jsonl)",
        "about 5 min with the defaults on a 2-core CPU alone, 13 min measured while shared "
        "(--steps 200 --seq-len 256: about 5 times that)",
        "cli.train:finetune",
        "cli.train:finetune_parser",
        own_defaults=(
            "--model",
            "--data",
            "--lora-rank",
            "--lora-alpha",
            "--steps",
            "--batch-size",
            "--seq-len",
            "--lr",
            "--warmup",
            "--val-fraction",
            "--eval-batches",
            "--eval-every",
            "--log-every",
            "--checkpoint-every",
            "--keep",
            "--out",
        ),
    ),
    Command(
        "sample",
        "continue a prompt with any model, streamed",
        "seconds for a small model: load, compile (~10 s), then 10-30 tokens/s on a 2-core CPU",
        "cli.sample:main",
        "cli.sample:parser",
    ),
    Command(
        "chat",
        "chat with any model that has a chat template, streamed (default: SmolLM2-135M-Instruct)",
        "about 30 s to load and compile SmolLM2-135M on a 2-core CPU (75 s measured while shared), "
        "then ~10 tokens/s",
        "cli.chat:main",
        "cli.chat:parser",
        own_defaults=("--model",),
    ),
    Command(
        "merge",
        "fold LoRA adapters (a LoRA run, or --adapter) into their base: a complete HF directory",
        "about 15 s for SmolLM2-135M (load, merge, write the float32 weights; 27 s while shared)",
        "cli.export:merge",
        "cli.export:parser",
        own_defaults=("--out",),  # where it writes: required
    ),
    Command(
        "export",
        "write any model as a complete HF directory (weights, config, tokenizer, generation)",
        "about 10 s for SmolLM2-135M",
        "cli.export:main",
        "cli.export:parser",
        own_defaults=("--out",),
    ),
    Command(
        "evaluate",
        "score any model on tasks: perplexity and bits per byte, multiple choice, generations "
        "by exact match or a checker (training.evaluate), or lm-eval's",
        "SmolLM2-135M on examples/data/brevity_heldout.jsonl (42 generate rows, 40 new tokens "
        "each: load, compile, generate) took 74 CPU seconds, about a minute on a 2-core CPU "
        "alone (10 min measured while shared)",
        "cli.evaluate:main",
        "cli.evaluate:parser",
        # Rows per batch (8), tokens per generate row (64), a results file (none): evaluation's.
        own_defaults=("--batch-size", "--max-new-tokens", "--out"),
    ),
    Command(
        "serve",
        "serve any model over OpenAI's HTTP API (chat and text completions, streamed; LoRA "
        "adapters per request; infer.serve)",
        "as chat's start: about 30 s to load and compile SmolLM2-135M on a 2-core CPU, then "
        "until stopped",
        "cli.serve:main",
        "cli.serve:parser",
        # NAME=PATH, repeatable: each adapter served as its own model, not folded into --model.
        own_kinds=("--adapter",),
    ),
    Command(
        "plan",
        "bytes per device and collectives of a training run on paper, and whether it fits a "
        "device (--device h100-80gb) with which remat and micro-batches",
        "seconds (no device needed)",
        "cli.plan:main",
        "cli.plan:parser",
    ),
    Command(
        "bench",
        "benchmarks: predicted (zoo.math) vs measured, written to bench/RESULTS.md-style tables",
        "minutes per benchmark on a CPU; `all` about an hour",
        "cli.bench:main",
        "cli.bench:parser",
        own_defaults=("--out",),  # where it writes results: none unless given
    ),
)
BY_NAME = {command.name: command for command in COMMANDS}


def epilog(prog: str) -> str | None:
    """The --help epilog of the command `prog` ("eqx-zoo NAME") names: its expected duration."""
    command = BY_NAME.get(prog.rsplit(" ", 1)[-1])
    return None if command is None else f"expected duration: {command.duration}"


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's parser: `doc`'s first paragraph (its module docstring) as the description,
    its expected duration as the epilog, every default shown in --help."""
    return argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[0],
        epilog=epilog(prog),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
