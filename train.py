"""Train a transformer from the zoo, top to bottom (in the spirit of nanoGPT's train.py).

    python train.py                          # a small GPT on the stdlib's own source, no download
    python train.py --model tiny-llama --override vocab_size=4096 --data corpus.jsonl
    python train.py --resume runs/default --steps 800     # continue a run exactly
    python train.py --model tiny-moe --override vocab_size=2048   # MoE: logs expert load
    python train.py --mesh fsdp=4,tensor=2 --rules fsdp_tp        # sharded over 8 devices
    python train.py --init-from SmolLM2.gguf --data my.jsonl --lr 3e-5   # fine-tune
    python train.py --init-from SmolLM2.gguf --data examples/data/chat.jsonl --lr 3e-5  # chat SFT
    python train.py --init-from SmolLM2.gguf --dtype bfloat16 --remat full  # bf16 compute
    python train.py --mesh pipeline=4,data=2 --pipeline-schedule 1f1b       # a pipeline
    python train.py --coordinator host0:1234 --num-processes 2 --process-id 0 ...  # on each host
    python train.py --help                   # every setting; --config FILE sets them from a file

In Python: `train.run(Args(...)) -> RunResult` (examples/ call it).

Every run owns its run directory (`--out`): it records what defines the run in `run.json`, holds
a lock while it trains, and writes `metrics.jsonl`, `checkpoints/` and `loss.png`. It prints the
predicted (zoo.math roofline) next to the measured step time and memory, and logs loss, tokens/s,
step time, data-wait time and MFU. The step is compiled before the loop, and metrics stay on
the device until a log step (no host sync per step); logging, evaluation and checkpoints are the
loop's periodic hooks (training/loop.py).

Several processes (one per host, `--coordinator/--num-processes/--process-id` or a launcher's
environment: training/distributed.py) run one run: each loads only its rows of every batch,
process 0 holds the run directory and writes its record, metrics, plot and log, every process
writes its shards of each checkpoint.
"""

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from data import packing, supervised
from data.corpus import write_stdlib_corpus
from data.datasets import ROW, load_examples, quiet_progress, tokenize
from data.formats import row_messages
from data.prefetch import Prefetcher
from data.supervised import PAIR_ROLES
from data.tokenizers import OPENAI_ENCODINGS, get_tokenizer, save_ranks
from layers.moe import MoEStats
from shard import Placement
from shard.compile_cache import use_compile_cache
from shard.sequence import check_sequence_length
from shard.xla_flags import set_default_xla_flags
from training import distributed, loop, lora_run, offload, preference_run, run_model
from training import run_dir as runs
from training.args import (
    ArgError,
    Args,
    accumulation,
    check,
    check_batch_shards,
    given,
    parse_args,
    pipeline_stages,
)
from training.distributed import Processes
from training.loss import CrossEntropy
from training.model_config import (
    DEFAULT_MODEL,
    aux_weights,
    check_fits,
    check_imported,
    policy,
    preset_config,
    with_context_kernel,
)
from training.optimizer import adamw, learning_rate
from training.preference import PreferenceObjective
from training.step import compile_steps, split_model
from training.telemetry import Telemetry, compiled_memory_bytes, hardware, set_aside_abandoned
from zoo import Transformer
from zoo import math as zmath

# The settings that define a run: a --resume takes them from the run's record and refuses a
# flag that contradicts one. (--steps may grow; run-time settings such as --remat may change.)
DEFINING = ("model", "override", "init_from", "data", "text_column", "data_format", "truncate",
            "streaming", "tokenizer", "preference_loss", "beta", "simpo_gamma",
            "vocab_size", "seq_len", "batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup",
            "schedule", "weight_decay", "clip", "param_dtype", "seed", "val_fraction",
            "moe_balance_weight", "moe_z_weight", "router_bias_rate", "lora_rank", "lora_alpha",
            "lora_targets", "base_dtype")  # fmt: skip


@dataclasses.dataclass
class RunResult:
    """What a run ends with: its directory, the trained model and tokenizer, the last step, its
    training and validation loss (and the starting validation loss of a fine-tune), the corpus's
    unigram entropy, the last MoE statistics and the last metrics record."""

    run_dir: Path
    model: Transformer
    encoding: Any
    step: int
    loss: float | None
    val_loss: float | None
    initial_val_loss: float | None
    unigram_entropy: float
    moe: MoEStats | None
    record: dict


def say(message: str) -> None:
    """Print a log line (process 0 alone speaks for a run of several)."""
    if jax.process_index() == 0:
        tqdm.write(message, file=sys.stdout)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    p = np.bincount(tokens.ravel()).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def init_tokenizer_spec(path: str) -> str:
    """The tokenizer that comes with --init-from: a pretrained checkpoint's own, or the one a
    train.py run recorded (as `run_dir.tokenizer_from_spec` reads it)."""
    if not runs.is_run(path):
        return str(Path(path).resolve())
    try:
        return runs.recorded_tokenizer_spec(path)
    except ValueError as error:
        raise ValueError(f"--init-from {path!r}: {error}; or pass --tokenizer") from None


def make_tokenizer(args: Args, sample, cache: Path, run_dir: Path):
    """A resumed run's own tokenizer; --init-from's; else the one --tokenizer names (a BPE is
    trained on `sample` and cached)."""
    if args.resume:
        return runs.tokenizer_from_spec(runs.recorded_tokenizer_spec(run_dir))
    if args.init_from and args.tokenizer == "bpe":
        return runs.tokenizer_from_spec(init_tokenizer_spec(args.init_from))
    return get_tokenizer(
        args.tokenizer, texts=sample, vocab_size=args.vocab_size, cache_dir=cache, log=say
    )


def chat_tokenizer(args: Args, data_format: str, sample, cache: Path, run_dir: Path):
    """The tokenizer for instruction data: a checkpoint's own with its chat template when the
    run has one (resumed, or --init-from's), else `make_tokenizer`'s tiktoken encoding (refused
    for chat data, before a BPE is trained for nothing)."""
    spec = None
    if args.resume:
        spec = runs.recorded_tokenizer_spec(run_dir)
    elif args.init_from and args.tokenizer == "bpe":
        spec = init_tokenizer_spec(args.init_from)
    if spec is not None:
        return runs.chat_tokenizer_from_spec(spec)
    if data_format == "chat":
        raise ValueError(
            f"--data-format chat: the conversations are rendered with a checkpoint's chat "
            f"template, and --tokenizer {args.tokenizer!r} has none: pass --init-from a "
            "checkpoint (HF directory or .gguf) whose tokenizer has a chat template"
        )
    return make_tokenizer(args, sample, cache, run_dir)


def split_rows(args: Args, dataset):
    """(training rows, held-out rows, rows to train a BPE on): a seeded split by
    `--val-fraction`, or, streamed, `--eval-batches` batches held out from the shuffled stream's
    head and a sample of its first 2000 rows."""
    if args.streaming:
        dataset = dataset.shuffle(seed=args.seed, buffer_size=1000)
        n_val = args.eval_batches * args.batch_size
        return dataset.skip(n_val), dataset.take(n_val), dataset.take(2000)
    train_idx, val_idx = packing.split_documents(len(dataset), args.val_fraction, args.seed)
    train = dataset.select(train_idx)
    return train, dataset.select(val_idx), train


def load_examples_data(args: Args, dataset, data_format: str, cache: Path, run_dir: Path):
    """`load_data` for instruction data (data/formats.py, data/supervised.py): examples rendered
    with the tokenizer's chat template (or prompt + completion without one), whole in their rows,
    the loss on the answer tokens only; the entropy is the answer tokens' unigram entropy."""
    train_rows, val_rows, sample_rows = split_rows(args, dataset)
    sample = (  # texts for a BPE trained on the data (prompt/completion data only)
        "\n".join(m["content"] for m in row_messages(row, data_format, row[ROW], PAIR_ROLES))
        for row in sample_rows
    )
    tokenizer = chat_tokenizer(args, data_format, sample, cache, run_dir)
    supervised.check_tokenizer(tokenizer, data_format)
    say(f"data: rendering the {data_format} examples with the chat template and packing them ...")
    roles = supervised.roles(tokenizer)
    encoding = getattr(tokenizer, "encoding", tokenizer)
    eot = encoding.eot_token

    def examples(rows, counts: supervised.Counts):
        pairs = (
            (row[ROW], supervised.encode_example(
                tokenizer, row_messages(row, data_format, row[ROW], roles)))
            for row in rows
        )  # fmt: skip
        return supervised.fit(pairs, args.seq_len, truncate=args.truncate, counts=counts)

    val_counts = supervised.Counts()
    val_tokens, val_segments, val_answers = packing.pack_examples(
        examples(val_rows, val_counts), args.seq_len, eot
    )
    val = packing.Batches(
        val_tokens, val_segments, min(args.batch_size, len(val_tokens)), args.seed, val_answers
    )
    say(f"data: format {data_format}; held out: {val_counts.line()}")
    if args.streaming:
        train = packing.StreamBatches(
            lambda: examples(train_rows, supervised.Counts()), args.seq_len, eot,
            args.batch_size, examples=True,
        )  # fmt: skip
        entropy = unigram_entropy(val_tokens[val_answers])
        say("data: training examples are streamed (counted as they are read, not in advance)")
    else:
        counts = supervised.Counts()
        tokens, segments, answers = packing.pack_examples(
            examples(train_rows, counts), args.seq_len, eot
        )
        train = packing.Batches(tokens, segments, args.batch_size, args.seed, answers)
        entropy = unigram_entropy(tokens[answers])
        say(f"data: training: {counts.line()}; packed whole into {len(tokens):,} rows")
    return encoding, train, val, entropy


def load_data(args: Args, run_dir: Path):
    """Tokenizer, training batches, validation batches (their first `--eval-batches` in order
    are the held-out set), the unigram entropy and the data's format (`--data-format`, or the
    one `auto` found); datasets' own progress bars off. Preference data gives the tokenizer and
    its pairs (training/preference_run.py), whose reference log-probabilities come later."""
    say(f"data: reading {args.data} ...")
    with quiet_progress():
        return _load_data(args, run_dir)


def _load_data(args: Args, run_dir: Path):
    cache = Path(args.cache_dir).expanduser()
    spec = str(write_stdlib_corpus(cache)) if args.data == "stdlib" else args.data
    dataset, data_format = load_examples(
        spec, data_format=args.data_format, text_column=args.text_column, streaming=args.streaming
    )
    preference_run.check_settings(args, data_format)
    if data_format == "preference":  # pairs; their reference is attached with the model
        train_rows, val_rows, _ = split_rows(args, dataset)
        tokenizer = chat_tokenizer(args, data_format, (), cache, run_dir)
        return *preference_run.load(args, tokenizer, train_rows, val_rows, say), data_format
    if data_format != "text":
        return (*load_examples_data(args, dataset, data_format, cache, run_dir), data_format)
    say(f"data: format text (column {args.text_column!r})")
    train_docs, val_docs, sample_docs = split_rows(args, dataset)
    column = args.text_column
    sample = (d[column] for d in sample_docs) if args.streaming else sample_docs[column]
    encoding = make_tokenizer(args, sample, cache, run_dir)
    eot = encoding.eot_token

    def ids(docs):
        return (d["ids"] for d in tokenize(docs, encoding, column=args.text_column))

    say(f"data: tokenizing and packing into rows of {args.seq_len} tokens ...")
    val_tokens, val_segments = packing.pack(ids(val_docs), args.seq_len, eot)
    val = packing.Batches(
        val_tokens, val_segments, min(args.batch_size, len(val_tokens)), args.seed
    )
    if args.streaming:
        train = packing.StreamBatches(lambda: ids(train_docs), args.seq_len, eot, args.batch_size)
        entropy = unigram_entropy(val_tokens)
    else:
        tokens, segments = packing.pack(ids(train_docs), args.seq_len, eot)
        train = packing.Batches(tokens, segments, args.batch_size, args.seed)
        entropy = unigram_entropy(tokens)
        say(
            f"data: {tokens.size:,} training tokens in {len(tokens):,} rows, "
            f"{val_tokens.size:,} held out"
        )
    return encoding, train, val, entropy, data_format


def stop_not_finite(what: str, run_dir: Path) -> None:
    last = runs.checkpoints(run_dir)
    raise FloatingPointError(
        f"{what} is not finite: stopping. The last good checkpoint is kept: "
        f"{last[-1] if last else 'none written yet'}. Try a lower --lr or --clip."
    )


@jax.jit
def all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(w)) for w in jax.tree.leaves(params)]))


def evaluate(eval_fn, params, batches) -> float:
    totals = [eval_fn(params, b) for b in batches]
    return float(sum(t[0] for t in totals) / sum(t[1] for t in totals))


def moe_line(moe: MoEStats) -> str:
    """Per-expert share of the token->expert assignments (averaged over MoE layers; 1/n each
    when balanced) and the fraction of assignments dropped by capacity dispatch."""
    load = np.asarray(moe.expert_load).mean(axis=0)
    dropped = float(np.asarray(moe.dropped_fraction).mean())
    return f"expert load [{' '.join(f'{x:.2f}' for x in load)}] | dropped {dropped:.1%}"


def build_model(
    args: Args, placement: Placement, n_vocab: int, key, run_dir: Path
) -> tuple[Transformer, str]:
    """(model in its placement, its name): a pretrained checkpoint or a train.py run's latest
    checkpoint loaded straight into its shardings, or a fresh preset created in them; the
    run-time policy from the flags either way; with `--lora-rank`, that model as the frozen base
    of LoRA adapters (training/lora_run.py). A resumed run's model is built from its record (its
    trained weights are restored afterwards): abstract, or for a LoRA run the base re-read (and
    checked against its recorded fingerprint) with fresh adapters."""
    run_policy = policy(args)
    if args.resume:
        name = runs.read_record(run_dir)["settings"].get("init_from") or args.model
        if args.lora_rank:
            return run_model.lora_model(run_dir, run_policy, placement), name
        config = runs.checkpoint_config(run_dir)[0]
        return runs.abstract_model(config, run_policy), name or DEFAULT_MODEL
    if args.init_from:
        say(f"model: loading {args.init_from} ...")
        if runs.is_run(args.init_from):
            model = run_model.run_model(args.init_from, policy=run_policy, placement=placement)
        else:
            from zoo import load_pretrained  # needs the `checkpoints` extra (safetensors, gguf)

            # Float weights to train (a GGUF's quantized blocks would be frozen).
            model = load_pretrained(
                args.init_from, policy=run_policy, placement=placement, quantized=False
            )
        check_imported(args, model.config)
        check_fits(model.config, args, n_vocab, args.init_from)
        name = args.init_from
    else:
        config = preset_config(args, n_vocab)
        make = lambda key: Transformer(config, policy=run_policy, key=key)  # noqa: E731
        model = placement.init(make, jax.random.fold_in(key, 0))
        name = args.model or DEFAULT_MODEL
    if args.lora_rank:
        lora = lora_run.LoraSettings.of(vars(args))
        model = lora_run.adapt(model, lora, placement, jax.random.fold_in(key, 1))
    return model, name


def record_tokenizer(args: Args, encoding, run_dir: Path) -> str:
    """Leave the run's tokenizer in the run directory (so `run_model.load_run` and
    `eqx-zoo sample --model RUN` decode with it): a trained or rank-file BPE as a rank file, an
    OpenAI encoding name or the --init-from tokenizer as text. Returns its spec."""
    if args.init_from and args.tokenizer == "bpe":
        spec = init_tokenizer_spec(args.init_from)
        (run_dir / "tokenizer.source").write_text(spec)
        return spec
    if args.tokenizer in OPENAI_ENCODINGS:
        (run_dir / "tokenizer.source").write_text(args.tokenizer)
        return args.tokenizer
    save_ranks(encoding, run_dir / "tokenizer.tiktoken")
    return "tokenizer.tiktoken"


def resumed_args(args: Args, given_names: frozenset[str], run_dir: Path) -> Args:
    """`args` with the run's recorded defining settings; a given flag that contradicts one is an
    error naming the flag and both values. Without `--steps` the run trains to its own
    recorded target; a given `--steps` becomes its new target. A pipeline's micro-batch count,
    unless given, is chosen again for the recorded batch."""
    record = runs.read_record(run_dir)
    recorded, step = record["settings"], runs.latest_step(run_dir)
    if not recorded.get("lora_rank"):  # runs before Args' lora_targets=None recorded a string
        recorded["lora_targets"] = None
    changes = {}
    if "steps" in given_names and args.steps <= step:
        raise ArgError(
            "--steps",
            f"{args.steps} is not beyond the run's step {step}: --resume continues to "
            f"--steps, so give more than {step}",
        )
    if "steps" not in given_names and "steps" in recorded:
        changes["steps"] = recorded["steps"]
        if recorded["steps"] <= step:
            raise ArgError(
                "--steps",
                f"--resume {str(run_dir)!r}: the run reached its target, step {step} of "
                f"{recorded['steps']}; give --steps beyond {step} to train it further",
            )
    elif "steps" not in given_names:  # a run recorded before its target was
        raise ArgError(
            "--steps",
            f"--resume {str(run_dir)!r}: the run records no target number of steps (it was "
            "started by an older train.py); give --steps",
        )
    for name in DEFINING:
        value = getattr(args, name)
        if name == "init_from":  # where the run started; a resume continues from the run
            continue
        if name not in recorded:  # a run recorded before the setting existed had its default
            recorded[name] = getattr(Args(), name)
        if name in given_names and value != recorded[name]:
            raise ArgError(
                f"--{name.replace('_', '-')}",
                f"--resume {str(run_dir)!r} continues a run recorded with {recorded[name]!r}, "
                f"not {value!r}; drop the flag (or start a new run with another --out)",
            )
        changes[name] = recorded[name]
    if "microbatches" not in given_names:
        changes["microbatches"] = None
    args = dataclasses.replace(args, **changes)
    check(args)
    if args.steps != recorded.get("steps") and jax.process_index() == 0:  # process 0 writes
        runs.write_record(run_dir, {**record, "settings": {**recorded, "steps": args.steps}})
    return args


def log_step(telemetry, step, metrics, config, schedule, *, timing, predicted_line) -> dict | None:
    """Print and record one metrics line; the first step's (the starting point, e.g. the
    pretrained model's loss) has no `timing` (step seconds, data-wait seconds). Returns the
    timed record."""
    loss, grad_norm = float(metrics.loss), float(metrics.grad_norm)
    stats = {name: float(value) for name, value in metrics.stats.items()}
    moe = {**stats}
    if config.n_experts:
        moe = {
            "aux_loss": float(metrics.aux_loss),
            "expert_load": np.asarray(metrics.moe.expert_load).tolist(),
            "dropped_fraction": np.asarray(metrics.moe.dropped_fraction).tolist(),
        }
    shown = "".join(f" | {name} {value:.3f}" for name, value in stats.items())
    if timing is None:
        telemetry.log(step=step, loss=loss, grad_norm=grad_norm, **moe)
        say(f"step {step}: loss {loss:.4f}{shown}")
        return None
    step_s, wait_s = timing
    if predicted_line:
        say(telemetry.predicted_line(step_s))
    record = telemetry.log(
        step=step,
        loss=loss,
        grad_norm=grad_norm,
        lr=float(schedule(step - 1)),
        step_s=step_s,
        data_wait_s=wait_s,
        tokens_per_s=telemetry.tokens_per_step / step_s,
        mfu=telemetry.mfu(step_s),
        **moe,
    )
    say(
        f"step {step:5d} | loss {loss:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"{step_s * 1e3:.0f} ms/step | data wait {wait_s * 1e3:.2f} ms | MFU {record['mfu']:.1%}"
        f"{shown}"
    )
    if config.n_experts:
        say(f"           | aux loss {moe['aux_loss']:.4f} | {moe_line(metrics.moe)}")
    return record


def pipeline_line(args: Args, config, placement: Placement, chosen: bool) -> str:
    """What a pipeline does per step: stages, schedule, micro-batches (and whether they were
    chosen here), and zoo.math's bubble and activation memory per stage."""
    stages, (accum, m) = pipeline_stages(args), accumulation(args)
    virtual = args.virtual_stages if args.pipeline_schedule == "interleaved" else 1
    bubble = zmath.pipeline_bubble(stages, m, virtual=virtual)
    tokens = args.batch_size // accum * args.seq_len // (placement.devices // stages)
    activations = zmath.pipeline_activation_bytes(
        config, args.seq_len, policy(args), tokens=tokens, stages=stages, microbatches=m,
        schedule=args.pipeline_schedule, virtual=virtual,
    )  # fmt: skip
    how = (
        f"the most up to 4 x {stages} stages that split each batch of "
        f"{args.batch_size // accum} evenly over the batch's mesh axes; --microbatches to choose"
        if chosen
        else "--microbatches"
    )
    return (
        f"pipeline: {stages} stages, {args.pipeline_schedule} schedule"
        f"{f' ({virtual} virtual stages per device)' if virtual > 1 else ''}, {m} micro-batches "
        f"of {args.batch_size // accum // m} sequences ({how}); predicted (zoo.math): bubble "
        f"{bubble:.1%} of the step, activations {activations / 1e9:.3f} GB per stage"
    )


def main(argv: list[str] | None = None, **command) -> RunResult:
    """The command line: `run` on the parsed flags. `command` (`prog`, `description`,
    `overrides` of the defaults, `epilog`) describes the command line that calls it (the CLI's
    `eqx-zoo train` and `eqx-zoo finetune`, training.args.parser)."""
    return run(parse_args(argv, **command), given_names=given(argv))


def run(args: Args, *, given_names: frozenset[str] | None = None) -> RunResult:
    """Train as `args` say. `given_names` are the settings the user chose (a --resume may not
    contradict them); default: those that differ from Args' defaults."""
    if given_names is None:
        defaults = Args()
        given_names = frozenset(
            f.name
            for f in dataclasses.fields(Args)
            if getattr(args, f.name) != getattr(defaults, f.name)
        )
    processes = distributed.start(args)  # before anything touches a device
    placement = Placement.from_flags(args.mesh, args.rules)  # a bad mesh fails before any work
    check_batch_shards(args)
    try:
        check_sequence_length(args.seq_len, placement.sequence_shards)
    except ValueError as error:
        raise ValueError(f"--seq-len {args.seq_len}: {error}") from None
    if args.offload_opt_state:
        offload.check_supported(placement.mesh.devices.flat if placement.sharded else jax.devices())
    run_dir = Path(args.resume or args.out)
    if args.init_from and Path(args.init_from).resolve() == run_dir.resolve():
        raise ValueError(
            f"--init-from {args.init_from!r} is this run's own directory: --init-from starts a "
            "new run from it (give another --out), --resume continues it"
        )
    # Process 0 holds the run directory; every process checks it runs the same run.
    lock = distributed.agree(
        processes,
        args,
        run_dir,
        lambda: runs.claim(run_dir, resume=bool(args.resume), overwrite=args.overwrite),
    )
    try:
        if args.resume:
            args = resumed_args(args, given_names, run_dir)
        result = _train(args, placement, run_dir, processes, given_names)
    finally:
        if lock is not None:
            lock.close()
    distributed.stop(processes)
    return result


def data_feeds(
    args: Args, placement: Placement, objective, model: Transformer, train_data, val_data,
    run_dir: Path,
) -> tuple[list, Callable[[int], Prefetcher]]:  # fmt: skip
    """(the held-out batches on the devices, `train_batches(position)`). Each process loads only
    the rows of every batch its devices hold; preference pairs (one process only,
    training/preference_run.py) first get their reference log-probabilities from `model` and
    are loaded whole."""
    if isinstance(objective, PreferenceObjective):
        place = partial(placement.batch, axes=objective.batch_axes)
        train_data, val_batches = preference_run.attach_reference(
            args, model, train_data, val_data, run_dir, place, say
        )
        return [place(b) for b in val_batches], lambda at: Prefetcher(train_data.iterate(at), place)
    rows = placement.process_rows(val_data.batch_size, args.seq_len)
    val_batches = [
        placement.batch(b, rows=rows, total=val_data.batch_size)
        for b in val_data.in_order(args.eval_batches, rows)
    ]
    train_rows = placement.process_rows(args.batch_size, args.seq_len)
    return val_batches, lambda at: Prefetcher(
        train_data.iterate(at, train_rows),
        lambda b: placement.batch(b, rows=train_rows, total=args.batch_size),
    )


@dataclasses.dataclass
class Job:
    """Everything the loop needs, prepared by `prepare`: the run's settings and directory, its
    processes, the compiled steps and their state, the data (`train_batches(position)`, the
    training batches from number `position` on, prefetched onto the devices) and the telemetry;
    `result` is filled in as the run goes."""

    args: Args
    run_dir: Path
    processes: Processes
    placement: Placement
    config: Any
    static: Any
    params: Any
    opt_state: Any
    train_fn: Any
    eval_fn: Any
    schedule: Any
    telemetry: Telemetry
    train_batches: Callable[[int], Prefetcher]
    val_batches: list
    start: int
    position: int
    rng: jax.Array
    result: RunResult


def prepare(
    args: Args, placement: Placement, run_dir: Path, processes: Processes, given_names
) -> Job:
    """Data, tokenizer, model (fresh, imported or restored), the run's record, the optimizer
    and the compiled step, each announced on the log."""
    start = 0
    if args.resume:
        start = runs.latest_step(run_dir)
        if args.steps <= start:
            raise ArgError(
                "--steps",
                f"{args.steps} is not beyond the run's step {start}: --resume continues to "
                f"--steps, so give more than {start}",
            )
    # Process 0 first: it fills the caches (corpus, trained tokenizer) the others then read.
    encoding, train_data, val_data, entropy, data_format = distributed.primary_first(
        processes, lambda: load_data(args, run_dir)
    )
    # Recorded as found, not `auto`: a resume reads its data in the same format or fails.
    args = dataclasses.replace(args, data_format=data_format)
    say(
        f"tokenizer: {encoding.name}, {encoding.n_vocab} tokens; unigram entropy {entropy:.3f} nats"
    )
    key = jax.random.key(args.seed)
    model, name = build_model(args, placement, encoding.n_vocab, key, run_dir)
    model = with_context_kernel(model, args, placement)
    config, run_policy = model.config, model.policy
    objective = CrossEntropy(aux_weights(args))
    if data_format == "preference":
        objective = PreferenceObjective(preference_run.preference_loss(args), aux_weights(args))
    val_batches, train_batches = data_feeds(
        args, placement, objective, model, train_data, val_data, run_dir
    )
    if not args.resume and processes.primary:
        spec = record_tokenizer(args, encoding, run_dir)
        settings = {name: getattr(args, name) for name in (*DEFINING, "steps")}
        record = {"settings": settings, "config": config.to_dict(), "tokenizer": spec}
        if args.lora_rank and args.init_from:
            base = Path(args.init_from).resolve()
            record["base"] = {"path": str(base), "sha256": lora_run.fingerprint(base)}
        runs.write_record(run_dir, record)
    params, static = split_model(model)
    n_trainable = sum(x.size for x in jax.tree.leaves(params))
    n_params = zmath.param_count(config)
    trains = (
        f"LoRA rank {args.lora_rank} on {args.lora_targets}: {n_trainable / 1e6:.3f}M of "
        f"{n_params / 1e6:.2f}M parameters train ({100 * n_trainable / n_params:.2f}%), base "
        f"held in {args.base_dtype or run_policy.param_dtype}"
        if args.lora_rank
        else f"{n_params / 1e6:.2f}M parameters"
    )
    where = f"; {processes.describe()}" if processes.count > 1 else ""
    say(
        f"model: {name}, {trains}, compute {run_policy.compute_dtype}, "
        f"kernel {run_policy.kernel_name}, on {placement.describe()}{where}"
    )
    if pipeline_stages(args) > 1:
        say(pipeline_line(args, config, placement, "microbatches" not in given_names))
    schedule = learning_rate(
        args.schedule,
        peak=args.lr,
        steps=args.steps,
        warmup=args.warmup,
        min_ratio=args.min_lr_ratio,
    )
    optimizer = adamw(schedule, weight_decay=args.weight_decay, clip=args.clip)
    position, rng = 0, key
    memory = None  # --offload-opt-state: the state's (device, host) shardings
    if args.offload_opt_state:
        memory = offload.state_shardings(placement, optimizer, params)
        say(f"optimizer state: in {offload.HOST} memory between steps (--offload-opt-state)")
    if args.resume:
        restored = runs.restore(
            run_dir, model=model, optimizer=optimizer, placement=placement,
            opt_state_shardings=memory and memory[1],
        )  # fmt: skip
        params, opt_state = restored.params, restored.opt_state
        position, rng = restored.data_position, restored.rng
        say(f"resumed from {restored.path} at step {start}")
        if processes.primary and (note := set_aside_abandoned(run_dir, start)):
            say(note)
    else:
        opt_state = placement.init_opt_state(optimizer, params)
        if memory is not None:
            opt_state = jax.device_put(opt_state, memory[1])
    accum = accumulation(args)[0]
    train_fn, eval_fn = compile_steps(
        static, optimizer, accum, placement=placement, model=model, opt_state_memory=memory,
        objective=objective,
    )  # fmt: skip
    del model  # its arrays are `params`, which the step donates
    say("compiling the train step ...")
    t0 = time.perf_counter()
    batch_spec = objective.abstract_batch(
        args.batch_size, args.seq_len, placement.batch_sharding(objective.batch_axes)
    )
    train_fn = train_fn.lower(params, opt_state, batch_spec).compile()
    hw = hardware(args.peak_flops, args.peak_bandwidth, run_policy.compute_dtype)
    lora = None
    if args.lora_rank:
        frozen = lora_run.frozen_bytes(lora_run.LoraSettings.of(vars(args)), config, run_policy)
        lora = (n_trainable, frozen)
    sequences = args.batch_size * (2 if data_format == "preference" else 1)  # a pair is two
    telemetry = Telemetry(
        run_dir, config, run_policy, sequences, args.seq_len, hw,
        accum=accum, lora=lora, write=processes.primary,
    )  # fmt: skip
    if args.resume:
        telemetry.forget_after(start)
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(telemetry.memory_line(compiled_memory_bytes(train_fn), placement.devices))
    result = RunResult(run_dir, None, encoding, start, None, None, None, entropy, None, {})
    return Job(
        args, run_dir, processes, placement, config, static, params, opt_state, train_fn,
        eval_fn, schedule, telemetry, train_batches, val_batches, start, position, rng, result,
    )  # fmt: skip


def hooks(job: Job, clock: loop.StepClock, checkpointer: runs.Checkpointer) -> list[loop.Hook]:
    """The loop's periodic hooks: log a metrics line (and the first step's, the starting
    point), evaluate on the held-out batches, write a checkpoint. The time the last two take
    is left out of the step time."""
    args, result, telemetry = job.args, job.result, job.telemetry

    def log(state: loop.State) -> None:
        timing = clock.lap()
        first_timed = timing is not None and not result.record
        result.record = log_step(
            telemetry, state.step, state.metrics, job.config, job.schedule, timing=timing,
            predicted_line=first_timed,
        ) or result.record  # fmt: skip
        if job.config.n_experts:
            result.moe = state.metrics.moe

    def validate(state: loop.State) -> None:
        with clock.paused():
            result.val_loss = evaluate(job.eval_fn, state.params, job.val_batches)
            telemetry.log(step=state.step, val_loss=result.val_loss)
            say(
                f"step {state.step:5d} | validation loss {result.val_loss:.4f} "
                f"(unigram entropy {result.unigram_entropy:.3f})"
            )

    def save(state: loop.State) -> None:
        with clock.paused():
            if not bool(all_finite(state.params)):
                stop_not_finite(f"the weights after step {state.step}", job.run_dir)
            blocked = checkpointer.save(
                params=state.params, opt_state=state.opt_state, step=state.step,
                data_position=job.position + state.step - job.start, rng=job.rng,
            )  # fmt: skip
            telemetry.log(step=state.step, checkpoint_blocked_s=blocked)
            say(
                f"step {state.step:5d} | checkpoint {checkpointer.path(state.step).name}: the "
                f"loop was blocked {blocked * 1e3:.1f} ms (written in the background)"
            )

    return [
        loop.Hook(args.log_every, log, first=True),
        loop.Hook(args.eval_every, validate),
        loop.Hook(args.checkpoint_every, save),
    ]


def _train(
    args: Args, placement: Placement, run_dir: Path, processes: Processes, given_names
) -> RunResult:
    job = prepare(args, placement, run_dir, processes, given_names)
    args, result = job.args, job.result
    if args.init_from and not args.resume:
        result.initial_val_loss = evaluate(job.eval_fn, job.params, job.val_batches)
        job.telemetry.log(step=0, val_loss=result.initial_val_loss)
        say(
            f"step     0 | validation loss {result.initial_val_loss:.4f} (the pretrained "
            "starting point)"
        )
    batches = job.train_batches(job.position)
    # Checkpoints are written in the background while the loop goes on (training/state.py).
    checkpointer = runs.Checkpointer(
        run_dir, config=job.config, policy=job.static.policy, keep=args.keep
    )
    bar = tqdm(
        total=args.steps, initial=job.start, disable=not (args.progress and processes.primary),
        desc="train",
    )  # fmt: skip
    clock = loop.StepClock(lambda: batches.wait_s)

    def check_finite(state: loop.State) -> None:
        loss, grad_norm = float(state.metrics.loss), float(state.metrics.grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            stop_not_finite(
                f"loss {loss} / gradient norm {grad_norm} at step {state.step}", run_dir
            )
        result.step, result.loss = state.step, loss

    try:
        state = loop.run(
            job.train_fn, job.params, job.opt_state, batches, start=job.start, stop=args.steps,
            hooks=hooks(job, clock, checkpointer), check=check_finite,
            on_step=lambda: (bar.update(1), clock.step()),
        )  # fmt: skip
    finally:
        batches.close()
        bar.close()
        waited = checkpointer.close()  # the last checkpoint is finalized before the run ends
    say(f"the last checkpoint was finalized {waited * 1e3:.1f} ms after the loop ended")
    result.model = eqx.combine(state.params, job.static)
    if processes.primary:
        plot = job.telemetry.plot(run_dir / "loss.png", result.unigram_entropy)
        if result.val_loss is not None:
            say(
                f"done: validation loss {result.val_loss:.3f} nats vs unigram entropy "
                f"{result.unigram_entropy:.3f} nats; metrics in {job.telemetry.path}, loss "
                f"curve in {plot}"
            )
    return result


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    use_compile_cache()  # a resumed or repeated run reads its programs back instead of compiling
    try:
        main()
    except (ValueError, FloatingPointError, OSError) as error:
        sys.exit(f"train.py: error: {error}")
