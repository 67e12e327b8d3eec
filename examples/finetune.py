"""Fine-tune a chat model with LoRA on a small chat dataset, then ask it a question it could not
answer before: `eqx-zoo finetune` (cli/train.py) followed by a chat turn (cli/chat.py).

    python -m examples.finetune                   # ~5 min on a 2-core CPU: SmolLM2-135M-Instruct,
                                                  # LoRA on examples/data/chat.jsonl
    python -m examples.finetune --steps 200 --seq-len 256  # the longer run (~25 min)
    python -m examples.finetune --lora-rank 0     # every weight trains (a full fine-tune)
    python -m examples.finetune --base-dtype nf4  # QLoRA: the frozen base held in 4 bits

examples/data/chat.jsonl holds 250 short conversations about Quillmora, an island country made up
for this example, so the base model cannot know the answers. Every `eqx-zoo finetune` flag can
be given; `--question` is asked of the tuned model afterwards. Each run replaces the last one in
`--out` (default runs/finetune).
"""

import argparse

from cli.chat import Chat
from cli.train import finetune
from shard.xla_flags import set_default_xla_flags
from training.run_model import run_tokenizer


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--question", default="What is the capital of Quillmora?")
    args, rest = p.parse_known_args(argv)
    result = finetune(["--overwrite", *rest], prog="python -m examples.finetune")
    max_len = min(512, result.model.config.max_seq_len)
    chat = Chat(result.model, run_tokenizer(result.run_dir), max_len=max_len, max_new_tokens=48)
    print(f"you> {args.question}\nbot> ", end="", flush=True)
    chat.reply(args.question)
    print()
    return result


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
