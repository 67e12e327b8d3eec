"""Train a tiny mixture-of-experts model on the embedded corpus (the stdlib's source) with
train.py's loop, then print how the router spreads tokens over the experts.

    python -m examples.train_moe                      # ~1-2 minutes on 2 CPU cores
    python -m examples.train_moe --moe-dispatch capacity --capacity-factor 1.0

`tiny-moe` is a 2-layer Llama whose MLPs are 4 SwiGLU experts, 2 per token (Mixtral's layout).
The Switch load-balancing loss and the ST-MoE router z-loss (`--moe-balance-weight`,
`--moe-z-weight`) are added
to the cross-entropy in training/loss.py; every log line shows the per-expert load and, for
capacity dispatch, the fraction of token->expert assignments dropped. Any train.py flag can be
appended. Each run replaces the last one in runs/moe (`--overwrite`: a scratch directory).
"""

import sys

import numpy as np

import train
from shard.xla_flags import set_default_xla_flags


def main(argv: list[str] | None = None) -> train.RunResult:
    summary = train.main(
        [
            "--model", "tiny-moe", "--override", "vocab_size=1024", "--vocab-size", "1024",
            "--seq-len", "64", "--batch-size", "16", "--steps", "150", "--warmup", "15",
            "--log-every", "25", "--eval-every", "75", "--out", "runs/moe",
            "--overwrite",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )  # fmt: skip
    load = np.asarray(summary.moe.expert_load)
    dropped = np.asarray(summary.moe.dropped_fraction)
    n = load.shape[-1]
    print(f"expert load at the last step (share of token->expert assignments; {1 / n:.2f} each "
          "when balanced):")  # fmt: skip
    for layer, (row, drop) in enumerate(zip(load, dropped, strict=True)):
        bars = " ".join(f"e{e} {x:.2f} {'#' * round(40 * x)}" for e, x in enumerate(row))
        print(f"  MoE layer {layer}: {bars} | dropped {drop:.1%}")
    return summary


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
