"""`eqx-zoo merge` and `eqx-zoo export`: a model written as a complete HF directory (weights,
config.json, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json)
that transformers' `AutoModelForCausalLM` + `AutoTokenizer` and every eqx-zoo command load.

    eqx-zoo merge --model runs/finetune --out merged/            # a LoRA run, adapters folded in
    eqx-zoo merge --model base.gguf --adapter adapter/ --out merged/
    eqx-zoo export --model SmolLM2.gguf --out smollm2-hf/          # any model artifact
    eqx-zoo export --model runs/default --out gpt-mini-hf/         # a run trained from scratch

`merge` folds LoRA adapters into the weights (W + (alpha / rank) A B; a quantized base is
dequantized first) and refuses a model without any; `export` writes any artifact, merging the
adapters it has. A non-empty `--out` is refused unless `--overwrite`.
"""

import argparse

from cli import commands, flags
from training.args import add_arguments
from training.artifacts import export, load_artifact
from zoo.adapter import has_lora
from zoo.pretrained.architectures import ARCHITECTURES


def parser(prog: str = "eqx-zoo export") -> argparse.ArgumentParser:
    p = commands.command_parser(prog, __doc__)
    flags.add_model(p)
    flags.add_chat_template(p)
    p.add_argument("--out", type=str, required=True, help="the HF directory to write")
    add_arguments(p, ("overwrite",))
    p.add_argument(
        "--architecture",
        choices=list(ARCHITECTURES),
        help="the HF class to write (default: the first whose layout holds the model)",
    )
    return p


def merge(argv: list[str] | None = None, prog: str = "eqx-zoo merge"):
    return _write(parser(prog).parse_args(argv), merging=True)


def main(argv: list[str] | None = None, prog: str = "eqx-zoo export"):
    return _write(parser(prog).parse_args(argv), merging=False)


def _write(args: argparse.Namespace, *, merging: bool):
    artifact = load_artifact(
        args.model, adapter=args.adapter, attention=args.attention,
        chat_template=args.chat_template,
    )  # fmt: skip
    if merging and not has_lora(artifact.model):
        raise ValueError(
            f"{artifact.describe()} holds no LoRA adapters to merge: give a LoRA run or "
            "--adapter, or use `eqx-zoo export` to write it as it is"
        )
    return export(artifact, args.out, overwrite=args.overwrite, architecture=args.architecture)
