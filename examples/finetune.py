"""Fine-tune a pretrained checkpoint on a dataset loaded with `datasets`, through train.py.

    python -m examples.finetune PATH_TO_HF_DIR_OR_GGUF my_corpus.jsonl     # a local file
    python -m examples.finetune PATH_TO_HF_DIR_OR_GGUF roneneldan/TinyStories   # hub (online)

The model and its tokenizer come from the checkpoint (`zoo.load_pretrained`,
`data.pretrained_tokenizer.tokenizer_from_pretrained`); everything else is train.py's loop:
a low learning rate, short warm-up, WSD schedule, and checkpoints under runs/finetune.
"""

import sys

import train

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    checkpoint, data, *more = sys.argv[1:]
    train.main(
        [
            "--init-from", checkpoint, "--data", data, "--out", "runs/finetune",
            "--lr", "3e-5", "--warmup", "20", "--schedule", "wsd", "--steps", "200",
            "--batch-size", "4", "--seq-len", "256", "--eval-every", "50", *more,
        ]
    )  # fmt: skip
