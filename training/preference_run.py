"""Preference tuning in a train.py run (`--data-format preference`): the flags
(`--preference-loss`, `--beta`, `--simpo-gamma`) as a `PreferenceLoss`, the pairs read and laid
out (data/preference.py), and the reference log-probabilities attached once the model exists.

The loop is train.py's own with `PreferenceObjective` as the step's objective: checkpoints,
`--resume`, LoRA and quantized bases, meshes and the metrics log work as for any run; the log
adds the pairs' accuracy (share whose chosen response the policy prefers by the loss's margin)
and mean margin. The reference log-probabilities are cached in the run directory
(`reference.npy`, `reference_val.npy`), so a resumed full fine-tune keeps its starting model's.
"""

from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from data.datasets import ROW
from data.preference import PreferenceBatches, encode_pair, fit_pairs, pair_rows, row_pair
from data.supervised import Counts, roles
from training.preference import DEFAULT_SIMPO_GAMMA, PreferenceLoss, cached_reference
from zoo import Transformer

REFERENCE_FILES = ("reference.npy", "reference_val.npy")


def preference_loss(args) -> PreferenceLoss:
    return PreferenceLoss(kind=args.preference_loss, beta=args.beta, gamma=args.simpo_gamma)


def check_settings(args, data_format: str) -> None:
    """The preference flags with data of another format are an error (they would do nothing);
    preference data streamed is one too (the reference pass reads every pair once, up front),
    and so is a run of several processes (the pass gathers every pair's log-probabilities on
    one host)."""
    if data_format != "preference":
        changed = {
            "--preference-loss": args.preference_loss != "dpo",
            "--beta": args.beta is not None,
            "--simpo-gamma": args.simpo_gamma != DEFAULT_SIMPO_GAMMA,
        }
        given = [flag for flag, is_set in changed.items() if is_set]
        if given:
            raise ValueError(
                f"{', '.join(given)} set a preference loss, but --data is {data_format} data: "
                "give chosen/rejected pairs (--data-format preference) or drop the flags"
            )
        return
    if not (args.init_from or args.resume):
        raise ValueError(
            "--data-format preference tunes a trained model against itself as it starts (the "
            "reference): pass --init-from a checkpoint (HF directory, .gguf or train.py run)"
        )
    if jax.process_count() > 1:
        raise ValueError(
            f"--data-format preference runs in one process, not {jax.process_count()}: the "
            "reference pass reads every pair's log-probabilities back to one host; train "
            "preference pairs on one host's devices (--mesh within one process)"
        )
    if args.streaming:
        raise ValueError(
            "--data-format preference cannot be --streaming: the reference model's "
            "log-probabilities are computed once for every pair before training; drop --streaming"
        )


def load(args, tokenizer, train_rows, val_rows, log: Callable[[str], None]):
    """(the tiktoken encoding, training pairs, held-out pairs, the unigram entropy of the chosen
    responses' tokens): the pairs as `PreferenceBatches` whose reference is still to be attached
    (`attach_reference`)."""
    allowed = roles(tokenizer)

    def arrays(rows, counts: Counts):
        pairs = (
            (row[ROW], encode_pair(tokenizer, *row_pair(row, row[ROW], allowed))) for row in rows
        )
        return pair_rows(
            fit_pairs(pairs, args.seq_len, truncate=args.truncate, counts=counts),
            args.seq_len,
            getattr(tokenizer, "encoding", tokenizer).eot_token,
        )

    counts, val_counts = Counts(), Counts()
    tokens, segments, answers = arrays(train_rows, counts)
    val = arrays(val_rows, val_counts)
    train = PreferenceBatches.of(tokens, segments, answers, args.batch_size, args.seed)
    held_out = PreferenceBatches.of(*val, min(args.batch_size, len(val[0])), args.seed)
    pairs_line = lambda c: c.line().replace("examples", "pairs")  # noqa: E731
    log(f"data: format preference; training: {pairs_line(counts)}")
    log(f"data: held out: {pairs_line(val_counts)}")
    chosen = tokens[:, 0][answers[:, 0]]
    p = np.bincount(chosen).astype(np.float64)
    p = p[p > 0] / p.sum()
    encoding = getattr(tokenizer, "encoding", tokenizer)
    return encoding, train, held_out, float(-(p * np.log(p)).sum())


def attach_reference(
    args, model: Transformer, train: PreferenceBatches, val: PreferenceBatches, run_dir: Path,
    place, log: Callable[[str], None],
) -> tuple[PreferenceBatches, list]:  # fmt: skip
    """(training batches with their reference log-probabilities, the fixed held-out batches):
    the reference is `model` as the run starts (adapters off), cached in the run directory; a
    loss without a reference (SimPO, ORPO) skips the pass."""
    if preference_loss(args).needs_reference:
        files = [run_dir / name for name in REFERENCE_FILES]
        train = cached_reference(files[0], model, train, args.batch_size, place, log)
        val = cached_reference(files[1], model, val, val.pairs.batch_size, place, log)
    return train, val.in_order(args.eval_batches)
