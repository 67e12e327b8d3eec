"""Everything a run can be told, as one typed dataclass, and the CLI built from it.

Each field's type gives the flag's parser (a `Literal` gives choices, a bool gives
`--x/--no-x`), its `help` metadata the text in `--help`. `--config FILE` (JSON or TOML, keys
named like the fields) sets defaults that flags on the command line override.

Every number is checked where it comes in. A numeric field carries `Bounds` (`POSITIVE_INT`,
`PROBABILITY`, ...; the parser refuses a number field without them), which parse its flag and
check the same setting given in a config file or in Python (`Args(...)`), so a bad value fails
as argparse fails, naming the flag (`train.py: error: argument --batch-size: must be a positive
integer, got -2`, exit status 2), never deep inside JAX. What no single flag can check (settings
that must agree) is `check(args)`."""

import argparse
import dataclasses
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal

from shard.mesh import parse_mesh
from shard.rules import mesh_axes_of, rules_for
from zoo.presets import presets


class ArgError(ValueError):
    """A bad setting: `flag` (e.g. "--warmup") and why. `parse_args` prints it as argparse does."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"argument {flag}: {reason}")
        self.flag, self.reason = flag, reason


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The values of a numeric setting: a finite `kind` (int or float) in [lo, hi], an end left
    out when `lo_open` / `hi_open`. `what` names the set in messages ("a positive integer")."""

    kind: type
    lo: float
    hi: float = math.inf
    what: str = "a number"
    lo_open: bool = False
    hi_open: bool = False

    def parse(self, text: str) -> int | float:
        """A flag's text -> its value; raises ValueError saying why not."""
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {self.what}, got {text!r}") from None
        return self.check(value, shown=text)

    def check(self, value, *, shown: str | None = None) -> int | float:
        """A value from Python or a config file; raises ValueError saying why it is out."""
        shown = shown if shown is not None else json.dumps(value)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (self.kind is int and not isinstance(value, int)):
            raise ValueError(f"must be {self.what}, got {shown}")
        if not math.isfinite(value) or value < self.lo or (self.lo_open and value == self.lo):
            raise ValueError(f"must be {self.what}, got {shown}")
        if value > self.hi or (self.hi_open and value == self.hi):
            limit = f"at most {self.hi}" if self.kind is int else self.what
            raise ValueError(f"must be {limit}, got {shown}")
        return self.kind(value)

    def flag_type(self):
        """The `type=` of an argparse argument: argparse prints `argument --flag: <why>`."""

        def parse(text: str):
            try:
                return self.parse(text)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None

        parse.__name__ = self.kind.__name__
        return parse


# Counts reach int32 arrays (optax's step count, the schedule's boundaries): at most 2**31 - 1.
_INT32 = 2**31 - 1
POSITIVE_INT = Bounds(int, 1, _INT32, "a positive integer")
NON_NEGATIVE_INT = Bounds(int, 0, _INT32, "a non-negative integer")
SEED = Bounds(int, 0, 2**63 - 1, "a non-negative integer")
# A byte-level BPE has the 256 bytes and <|endoftext|>; the trainer allocates per token, so a
# (mistyped) billion-token vocabulary would abort the process: 2**20 is 4x the largest in use.
VOCAB_SIZE = Bounds(int, 257, 2**20, "an integer of at least 257 (256 bytes + <|endoftext|>)")
POSITIVE = Bounds(float, 0, what="a positive finite number", lo_open=True)
NON_NEGATIVE = Bounds(float, 0, what="a non-negative finite number")
FRACTION = Bounds(float, 0, 1, "a number in [0, 1]")
OPEN_FRACTION = Bounds(float, 0, 1, "a number in (0, 1)", lo_open=True, hi_open=True)
PROBABILITY = Bounds(float, 0, 1, "a probability in (0, 1]", lo_open=True)


def bounds_of(field: dataclasses.Field) -> Bounds | None:
    return field.metadata.get("bounds")


def _help(text: str, *, bounds: Bounds | None = None, **kwargs):
    """A field with its `--help` text and, for a number, the `Bounds` its flag accepts."""
    return dataclasses.field(metadata={"help": text, "bounds": bounds}, **kwargs)


DEFAULT_WARMUP = 30
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclasses.dataclass(kw_only=True)
class Args:
    model: str | None = _help(
        "what to train: a zoo preset name, trained from scratch (default gpt-mini; see "
        "--override), or a model to fine-tune: an HF directory, a .gguf file or a train.py run "
        "directory (its architecture and tokenizer come with it)",
        default=None,
    )
    override: list[str] = _help(  # noqa: RUF009 (a field() with help text)
        "change an architecture field (zoo.Config) of the preset, FIELD=VALUE (repeatable), e.g. "
        "n_layers=2; refused with --init-from, whose architecture is the checkpoint's",
        default_factory=list,
    )
    data: str = _help(
        "'stdlib' (the embedded corpus), a local text/json/jsonl/parquet/csv file or directory, "
        "or a Hugging Face hub dataset name (online only)",
        default="stdlib",
    )
    text_column: str = _help("column holding the documents' text", default="text")
    data_format: Literal["auto", "text", "chat", "completion", "alpaca", "preference"] = _help(
        "what --data holds: text (documents, loss on every token), chat (a 'messages' column), "
        "completion ('prompt', 'completion') or alpaca ('instruction', 'input', 'output'), the "
        "loss on the answers only; preference ('prompt', 'chosen', 'rejected': pairs for "
        "--preference-loss); auto: found from the columns (text when there is a --text-column)",
        default="auto",
    )
    preference_loss: Literal["dpo", "ipo", "simpo", "orpo"] = _help(
        "with preference data: DPO (Rafailov et al. 2023), IPO (Azar et al. 2023), SimPO (Meng "
        "et al. 2024) or ORPO (Hong et al. 2024); SimPO and ORPO need no reference model",
        default="dpo",
    )
    beta: float | None = _help(
        "the preference loss's strength: DPO's beta, IPO's tau, SimPO's beta, ORPO's lambda "
        "(default: each paper's, 0.1, 0.1, 2.0 and 0.1)",
        default=None,
        bounds=POSITIVE,
    )
    simpo_gamma: float = _help(
        "SimPO's target reward margin gamma", default=1.0, bounds=NON_NEGATIVE
    )
    truncate: bool = _help(
        "cut instruction examples longer than --seq-len (and drop those left with no answer "
        "token) instead of stopping with an error",
        default=False,
    )
    streaming: bool = _help("stream the dataset instead of loading it whole", default=False)
    tokenizer: str = _help(
        "'bpe' (byte-level BPE trained on --data, cached), an OpenAI encoding name (gpt2, "
        "cl100k_base, ...) or a .tiktoken rank file",
        default="bpe",
    )
    vocab_size: int = _help(
        "tokens in a --tokenizer bpe vocabulary", default=2048, bounds=VOCAB_SIZE
    )
    steps: int = _help("optimizer steps in all", default=300, bounds=POSITIVE_INT)
    batch_size: int = _help("sequences per optimizer step", default=16, bounds=POSITIVE_INT)
    grad_accum: int = _help(
        "gradient accumulation: the batch is split into this many parts run one after another "
        "(with a pipeline axis in --mesh, each part streams through the stages in "
        "--microbatches micro-batches)",
        default=1,
        bounds=POSITIVE_INT,
    )
    seq_len: int = _help("tokens per sequence", default=128, bounds=POSITIVE_INT)
    lr: float = _help("peak learning rate", default=3e-3, bounds=POSITIVE)
    min_lr_ratio: float = _help(
        "final learning rate as a fraction of --lr", default=0.1, bounds=FRACTION
    )
    warmup: int | None = _help(
        f"linear warm-up steps, at most --steps (default: {DEFAULT_WARMUP}, or --steps if fewer)",
        default=None,
        bounds=NON_NEGATIVE_INT,
    )
    schedule: Literal["cosine", "wsd"] = _help(
        "after warm-up: cosine decay, or WSD (warmup-stable-decay)", default="cosine"
    )
    weight_decay: float = _help(
        "AdamW decoupled weight decay (matrices only)", default=0.1, bounds=NON_NEGATIVE
    )
    clip: float = _help(
        "clip gradients to this global norm (0: off)", default=1.0, bounds=NON_NEGATIVE
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _help("compute dtype", default="float32")
    param_dtype: Literal["float32", "bfloat16", "float16"] = _help(
        "dtype of the stored weights and so of the optimizer state (float32 master weights)",
        default="float32",
    )
    remat: Literal["none", "full", "dots"] = _help(
        "rematerialisation policy of each block", default="none"
    )
    attention: Literal["naive", "xla", "flash", "cudnn", "ring", "allgather"] | None = _help(
        "attention kernel (zoo.Policy.attention); default: the first of xla, flash, naive that "
        "computes the model and compiles here (naive for Gemma 2 on a CPU: xla cannot "
        "soft-cap), or on a mesh with a context axis the context-parallel kernel (ring, "
        "allgather) zoo.math predicts faster",
        default=None,
    )
    moe_dispatch: Literal["dropless", "capacity"] = _help(
        "how MoE layers send tokens to their experts (zoo.Policy.moe_dispatch)", default="dropless"
    )
    capacity_factor: float = _help(
        "with --moe-dispatch capacity: each expert's slots per sequence as a multiple of an even "
        "share",
        default=1.25,
        bounds=POSITIVE,
    )
    moe_balance_weight: float = _help(
        "weight of the MoE load-balancing loss (Switch)", default=0.01, bounds=NON_NEGATIVE
    )
    moe_z_weight: float = _help(
        "weight of the MoE router z-loss (ST-MoE)", default=0.001, bounds=NON_NEGATIVE
    )
    router_bias_rate: float = _help(
        "step of the aux-loss-free balancing bias after each optimizer step (DeepSeek-V3, "
        "models with router_bias; 0: the bias stays)",
        default=0.001,
        bounds=NON_NEGATIVE,
    )
    lora_rank: int = _help(
        "train LoRA adapters of this rank on a frozen base instead of every weight (0: full "
        "training)",
        default=0,
        bounds=NON_NEGATIVE_INT,
    )
    lora_alpha: float = _help(
        "LoRA scale numerator: the update is (alpha / rank) A B", default=16.0, bounds=POSITIVE
    )
    lora_targets: str | None = _help(
        "with --lora-rank: comma-separated projections to adapt, PEFT's names (q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj) or ours (zoo/adapter.py). Default: "
        f"every projection, {DEFAULT_LORA_TARGETS}",
        default=None,
    )
    base_dtype: Literal["float32", "bfloat16", "float16", "int8", "nf4"] | None = _help(
        "with --lora-rank: how the frozen base is held: a float dtype, or quantized (int8 per "
        "channel, or QLoRA's 4-bit NF4). Default: --param-dtype",
        default=None,
    )
    out: str = _help("run directory: metrics, checkpoints, loss curve", default="runs/default")
    overwrite: bool = _help(
        "replace what --out already holds (a run: its checkpoints, metrics and tokenizer are "
        "deleted; an HF directory: its model and tokenizer files)",
        default=False,
    )
    resume: str | None = _help(
        "continue the run in this directory from its latest checkpoint", default=None
    )
    init_from: str | None = _help(
        "the older name of --model with a checkpoint: start from a pretrained checkpoint (HF "
        "directory or .gguf) or a train.py run directory (its latest checkpoint) for "
        "fine-tuning: the architecture and the tokenizer (with --tokenizer bpe) come from it, "
        "the optimizer starts afresh; the run-time settings (--dtype, --param-dtype, --remat, "
        "--attention, --moe-dispatch) apply",
        default=None,
    )
    mesh: str | None = _help(
        "shard over a device mesh, e.g. fsdp=4,tensor=2 (axes data, fsdp, tensor, expert, "
        "context, pipeline; the sizes must multiply to the device count). Default: one device",
        default=None,
    )
    rules: Literal["dp", "fsdp", "tp", "fsdp_tp", "ep"] | None = _help(
        "sharding preset for --mesh (default: the one the mesh's shape suggests)", default=None
    )
    # --- pipeline parallelism (a `pipeline` axis in --mesh; shard/pipeline.py) ---------------
    microbatches: int | None = _help(
        "micro-batches streamed through the pipeline stages per forward (at least the pipeline "
        "size; each part of --grad-accum is split into them). Default: the most, up to 4 x the "
        "pipeline size, that split the batch evenly over the batch's mesh axes (printed)",
        default=None,
        bounds=POSITIVE_INT,
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = _help(
        "gpipe (every micro-batch's activations kept until the backward), 1f1b (forwards and "
        "backwards interleaved: at most 2 x stages micro-batches in flight, each stage's "
        "forward recomputed in its backward) or interleaved (--virtual-stages layer chunks per "
        "device: the bubble shrinks by that factor)",
        default="gpipe",
    )
    virtual_stages: int = _help(
        "with --pipeline-schedule interleaved: layer chunks per device (each stack's layers "
        "must divide by pipeline size x this)",
        default=2,
        bounds=POSITIVE_INT,
    )
    # --- several processes (jax.distributed: one process per host) --------------------------
    coordinator: str | None = _help(
        "HOST:PORT of process 0, which runs the coordination service (default: "
        "$JAX_COORDINATOR_ADDRESS, or what jax.distributed detects on SLURM / Open MPI)",
        default=None,
    )
    num_processes: int | None = _help(
        "processes in the run, one per host (default: detected by jax.distributed, else 1)",
        default=None,
        bounds=POSITIVE_INT,
    )
    process_id: int | None = _help(
        "this process's index, 0 .. --num-processes - 1 (default: detected)",
        default=None,
        bounds=NON_NEGATIVE_INT,
    )
    init_timeout: int = _help(
        "seconds to wait for every process to join (and, on the others, for the coordinator "
        "to be reachable) before stopping with an error",
        default=120,
        bounds=POSITIVE_INT,
    )
    heartbeat_timeout: int = _help(
        "seconds after which a silent process counts as dead: jax.distributed then stops every "
        "other process (resume the run from its last checkpoint with --resume)",
        default=30,
        bounds=POSITIVE_INT,
    )
    eval_every: int = _help(
        "evaluate on held-out data every N steps", default=100, bounds=POSITIVE_INT
    )
    eval_batches: int = _help("held-out batches per evaluation", default=8, bounds=POSITIVE_INT)
    val_fraction: float = _help(
        "fraction of documents held out for validation", default=0.05, bounds=OPEN_FRACTION
    )
    log_every: int = _help("log a metrics line every N steps", default=25, bounds=POSITIVE_INT)
    checkpoint_every: int = _help(
        "write a checkpoint every N steps", default=200, bounds=POSITIVE_INT
    )
    keep: int = _help("checkpoints to keep", default=3, bounds=POSITIVE_INT)
    offload_opt_state: bool = _help(
        "hold the optimizer state in pinned host memory between steps (training/offload.py)",
        default=False,
    )
    seed: int = _help("seed for initialisation and data order", default=0, bounds=SEED)
    cache_dir: str = _help(
        "cache for the stdlib corpus and trained tokenizers", default="~/.cache/eqx-zoo"
    )
    peak_flops: float = _help(
        "device peak FLOP/s for MFU (0: datasheet or measured at start-up)",
        default=0.0,
        bounds=NON_NEGATIVE,
    )
    peak_bandwidth: float = _help(
        "device bandwidth in bytes/s (with --peak-flops)", default=0.0, bounds=NON_NEGATIVE
    )
    progress: bool = _help("show a progress bar", default=True)

    def __post_init__(self):
        """Each number within its bounds, the defaults that depend on other settings resolved,
        then `check`: an `Args` built in Python is held to what the CLI accepts."""
        for field in dataclasses.fields(self):
            bounds, value = bounds_of(field), getattr(self, field.name)
            if bounds is not None and value is not None:
                try:
                    bounds.check(value)
                except ValueError as error:
                    raise ArgError(flag_name(field.name), str(error)) from None
        if self.init_from is not None:
            check_checkpoint("--init-from", self.init_from)
        if self.model is not None and self.model not in presets():
            # --model names a checkpoint to start from: the same setting as --init-from.
            check_checkpoint("--model", self.model)
            if self.init_from is not None:
                raise ArgError(
                    "--model",
                    f"{self.model!r} is a checkpoint to start from, and so is --init-from "
                    f"{self.init_from!r}: give one of them",
                )
            self.model, self.init_from = None, self.model
        if self.warmup is None:
            self.warmup = min(DEFAULT_WARMUP, self.steps)
        if self.lora_targets is not None and not self.lora_rank:
            raise ArgError(
                "--lora-targets",
                f"{self.lora_targets!r} names projections to adapt, and only a LoRA run adapts "
                "any (without --lora-rank every weight trains): give --lora-rank too, or drop "
                "--lora-targets",
            )
        if self.lora_rank and self.lora_targets is None:
            self.lora_targets = DEFAULT_LORA_TARGETS
        if self.mesh is not None:
            try:
                parse_mesh(self.mesh)
            except ValueError as error:
                raise ArgError("--mesh", str(error)) from None
        pipelined = self.mesh is not None and pipeline_stages(self) > 1
        if pipelined and self.microbatches is None and self.batch_size % self.grad_accum == 0:
            self.microbatches = default_microbatches(self)
        check(self)


def check_checkpoint(flag: str, path: str) -> None:
    """`path`, given to `flag`, names a model to start from: an HF directory, a .gguf file or a
    train.py run directory (training/artifacts.py tells them apart). Anything else is an
    `ArgError` naming the path and what is expected, before any data or tokenizer is read."""
    if path in presets():
        raise ArgError(flag, f"{path!r} is a zoo preset, not a checkpoint: give it with --model")
    if not Path(path).exists():
        raise ArgError(
            flag,
            f"{path!r} is neither a zoo preset ({', '.join(presets())}) nor a checkpoint that "
            "exists (an HF directory, a .gguf file or a train.py run)",
        )
    from training.artifacts import artifact_kind  # it imports the model code: only for a path

    try:
        artifact_kind(path, flag=None)
    except ValueError as error:
        raise ArgError(flag, str(error)) from None


def lora_target_names(text: str) -> tuple[str, ...]:
    """`--lora-targets q_proj,v_proj` as names."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def flag_name(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def pipeline_stages(args: Args) -> int:
    """The size of the `pipeline` axis of `--mesh` (1 without one)."""
    return parse_mesh(args.mesh).get("pipeline", 1) if args.mesh else 1


def batch_shards(args: Args) -> int:
    """Into how many pieces `--mesh` and `--rules` split the batch (1 without a mesh)."""
    if not args.mesh:
        return 1
    sizes = parse_mesh(args.mesh)
    axes = mesh_axes_of(rules_for(sizes, args.rules).mesh_axes("batch"))
    return math.prod(sizes.get(axis, 1) for axis in axes)


def default_microbatches(args: Args) -> int | None:
    """The most micro-batches, from the pipeline size up to 4 times it, into which each
    gradient-accumulation part of the batch splits evenly with every micro-batch divisible by
    the batch's mesh shards (None if none does)."""
    stages, part = pipeline_stages(args), args.batch_size // args.grad_accum
    fits = [m for m in range(stages, 4 * stages + 1) if part % (m * batch_shards(args)) == 0]
    return max(fits, default=None)


def accumulation(args: Args) -> tuple[int, int]:
    """(gradient-accumulation steps, pipeline micro-batches) of one optimizer step: `--grad-accum
    G` splits the batch into G parts run one after another (`training/step.py`); with a
    pipeline each part streams through the stages as `--microbatches M` micro-batches in one
    pass (`zoo/pipeline.py`), rows i::M (1 without a pipeline)."""
    return args.grad_accum, args.microbatches or 1


def check(args: Args) -> None:
    """What no single flag can check: settings that must agree. Raises `ArgError`."""
    if args.batch_size % args.grad_accum:
        raise ArgError(
            "--grad-accum",
            f"--batch-size {args.batch_size} is not divisible by --grad-accum {args.grad_accum}: "
            "every micro-batch has the same number of sequences; give a divisor of --batch-size",
        )
    check_pipeline_flags(args)
    check_processes(args)
    if args.warmup > args.steps:
        raise ArgError(
            "--warmup",
            f"{args.warmup} is more than --steps {args.steps}: the learning rate would never "
            f"reach --lr; give at most {args.steps}",
        )
    if args.resume is not None and args.init_from is not None:
        raise ArgError(
            "--model",
            f"--resume {args.resume!r} continues a run, whose model is its own; --model "
            f"{args.init_from!r} starts a new one from a checkpoint: give one of them",
        )
    if args.base_dtype is not None and not args.lora_rank:
        raise ArgError(
            "--base-dtype",
            f"{args.base_dtype} sets how a frozen base is held, and only a LoRA run has one: "
            "give --lora-rank too, or drop --base-dtype",
        )
    if args.lora_rank and not lora_target_names(args.lora_targets):
        raise ArgError("--lora-targets", "is empty: name at least one projection, e.g. q_proj")
    if (args.peak_flops > 0) != (args.peak_bandwidth > 0):
        given, missing = ("--peak-flops", "--peak-bandwidth")[:: 1 if args.peak_flops else -1]
        raise ArgError(
            missing,
            f"{given} is given, so {missing} is needed too (both, or neither to use the "
            "datasheet or measured values)",
        )


def check_pipeline_flags(args: Args) -> None:
    """--microbatches, --pipeline-schedule and --virtual-stages against the mesh and batch."""
    stages = pipeline_stages(args)
    if stages == 1:
        for flag, value, default in [
            ("--microbatches", args.microbatches, None),
            ("--pipeline-schedule", args.pipeline_schedule, "gpipe"),
        ]:
            if value != default:
                mesh = f"--mesh {args.mesh} has" if args.mesh else "one device has"
                raise ArgError(
                    flag,
                    f"{value} applies to a pipeline, and {mesh} no pipeline axis: add one "
                    "(e.g. --mesh pipeline=4,data=2) or drop the flag",
                )
        return
    part, shards = args.batch_size // args.grad_accum, batch_shards(args)
    if args.microbatches is None:  # `Args.__post_init__` found no count that fits
        raise ArgError(
            "--batch-size",
            f"{args.batch_size} (in --grad-accum {args.grad_accum} parts of {part}) splits "
            f"into no count of micro-batches from the {stages} pipeline stages of --mesh "
            f"{args.mesh} up to {4 * stages} with each micro-batch divisible by the batch's "
            f"{shards} mesh shards; give a --batch-size that is a multiple of "
            f"{args.grad_accum * stages * shards} (or --microbatches)",
        )
    m = args.microbatches
    if m < stages:
        raise ArgError(
            "--microbatches",
            f"{m} micro-batches are fewer than the {stages} pipeline stages of --mesh "
            f"{args.mesh}: some stage would never work; give --microbatches {stages} or more "
            "(the bubble, (stages - 1) / (micro-batches + stages - 1), shrinks with more)",
        )
    if part % (m * shards):
        raise ArgError(
            "--microbatches",
            f"{m} micro-batches of each --grad-accum part of {part} sequences (--batch-size "
            f"{args.batch_size} / --grad-accum {args.grad_accum}) must each hold a multiple of "
            f"the batch's {shards} mesh shards; give a --microbatches that divides "
            f"{part // shards}",
        )
    if args.pipeline_schedule == "interleaved" and args.virtual_stages < 2:
        raise ArgError(
            "--virtual-stages",
            f"{args.virtual_stages}: the interleaved schedule needs at least 2 layer chunks per "
            "device (1 is --pipeline-schedule gpipe)",
        )


def check_batch_shards(args: Args) -> None:
    """Each micro-batch (the batch, or each --grad-accum part of it) splits evenly over the
    devices `--mesh` gives the batch: checked once the mesh is known to fit the devices, before
    any data or model (XLA's sharding error came after them)."""
    shards, part = batch_shards(args), args.batch_size // args.grad_accum
    if pipeline_stages(args) > 1 or part % shards == 0:  # a pipeline's: check_pipeline_flags
        return
    parts = f" in --grad-accum {args.grad_accum} parts of {part}" if args.grad_accum > 1 else ""
    raise ArgError(
        "--batch-size",
        f"{args.batch_size}{parts} does not split evenly over the {shards} devices that --mesh "
        f"{args.mesh} (rules {args.rules or 'default'}) gives the batch: give a --batch-size "
        f"that is a multiple of {args.grad_accum * shards}, or a --mesh with fewer batch devices",
    )


def check_processes(args: Args) -> None:
    """--coordinator, --num-processes and --process-id that cannot describe a run."""
    if args.coordinator is not None:
        host, sep, port = args.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ArgError(
                "--coordinator",
                f"{args.coordinator!r} is not HOST:PORT (e.g. 10.0.0.1:1234, the address of "
                "process 0)",
            )
    index, count = args.process_id, args.num_processes
    if index is not None and count is not None and index >= count:
        raise ArgError(
            "--process-id",
            f"{args.process_id} is not below --num-processes {args.num_processes}: the "
            f"processes are numbered 0 .. {args.num_processes - 1}",
        )


def _flag_type(field: dataclasses.Field, tp) -> dict:
    """(argparse kwargs) for a field of type `tp`."""
    bounds = bounds_of(field)
    if bounds is not None:
        return {"type": bounds.flag_type(), "metavar": bounds.kind.__name__.upper()}
    origin, params = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (tp,) = [p for p in params if p is not type(None)]
        return _flag_type(field, tp)
    if typing.get_origin(tp) is Literal:
        return {"choices": typing.get_args(tp)}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(tp) is list:
        return {"action": "append"}
    if tp in (int, float):
        raise TypeError(
            f"Args.{field.name}: a number needs bounds, e.g. _help(..., bounds=POSITIVE_INT), "
            "so that a bad value fails at its flag"
        )
    return {"type": tp}


# Flags accepted but not listed in --help: older names of a setting another flag now gives.
HIDDEN = ("init_from",)


def add_arguments(
    p: argparse.ArgumentParser,
    names: tuple[str, ...] | None = None,
    *,
    defaults: bool = True,
    overrides: dict | None = None,
) -> None:
    """Add the flags of the `Args` fields `names` (default: all) to `p`, each with its help
    text, choices or bounds and its default (`overrides` replaces some: a command's own
    defaults, shown in its --help). `defaults=False` leaves unset flags out of the parsed
    namespace (`given`)."""
    overrides = overrides or {}
    fields = {f.name: f for f in dataclasses.fields(Args)}
    for name in names or fields:
        field = fields[name]
        default = field.default_factory() if callable(field.default_factory) else field.default
        default = overrides.get(name, default)
        kwargs = _flag_type(field, field.type)
        if not defaults:
            default = argparse.SUPPRESS
        elif kwargs.get("action") == "append":
            default = None
        p.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=default,
            help=argparse.SUPPRESS if name in HIDDEN else field.metadata["help"],
            **kwargs,
        )


DESCRIPTION = (
    "Train a transformer from eqx-zoo. With no flags: a small GPT on the Python standard "
    "library's own source code (no download)."
)


def parser(
    *,
    defaults: bool = True,
    prog: str | None = None,
    description: str = DESCRIPTION,
    overrides: dict | None = None,
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """The CLI (`prog`, e.g. "eqx-zoo finetune", with `overrides` as its defaults)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="JSON or TOML file of settings (flags override it)")
    add_arguments(p, defaults=defaults, overrides=overrides)
    return p


def _config_value(field: dataclasses.Field, value):
    """A value from a config file, checked as its flag would be; raises ValueError saying why."""
    tp, shown = field.type, json.dumps(value)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if optional and value is None:
        return None
    bounds = bounds_of(field)
    if bounds is not None:
        if isinstance(value, str):
            raise ValueError(f"must be {bounds.what}, got the string {shown}: write it unquoted")
        return bounds.check(value)
    if optional:
        (tp,) = [p for p in typing.get_args(tp) if p is not type(None)]
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"must be one of {list(typing.get_args(tp))}, got {shown}")
    elif tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {shown}")
    elif typing.get_origin(tp) is list:
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f'must be a list of strings such as ["n_layers=2"], got {shown}')
    elif not isinstance(value, tp):
        raise ValueError(f"must be a string, got {shown}")
    return value


def _read_config_file(path: str) -> dict:
    """The settings in a JSON or TOML file; ValueError naming the file (and the key) if bad."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path!r} does not exist (or is not a file)")
    try:
        text = file.read_text(encoding="utf-8")
        values = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except UnicodeDecodeError as error:
        raise ValueError(f"--config {path!r} is not UTF-8 text ({error})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        kind = "TOML" if file.suffix == ".toml" else "JSON (or name it .toml)"
        raise ValueError(f"--config {path!r} is not valid {kind}: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(
            f"--config {path!r} must hold an object of settings such as "
            f'{{"steps": 100}}, got {type(values).__name__}'
        )
    fields = {f.name: f for f in dataclasses.fields(Args)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"--config {path!r}: unknown settings {unknown}; known: {sorted(fields)}")
    for key, value in values.items():
        try:
            values[key] = _config_value(fields[key], value)
        except ValueError as error:
            raise ValueError(f"--config {path!r}: {key!r} ({flag_name(key)}) {error}") from None
    return values


def parse_args(argv: list[str] | None = None, **command) -> Args:
    """The settings of a run from the command line (and `--config`). A bad value exits as
    argparse does: status 2 and `<prog>: error: argument --flag: <why>` on stderr. `command`
    (`prog`, `description`, `overrides`, `epilog`) describes the command line, as `parser`."""
    p = parser(**command)
    namespace, _ = p.parse_known_args(argv)
    if namespace.config:
        try:
            p.set_defaults(**_read_config_file(namespace.config))
        except ValueError as error:
            p.error(str(error))
    values = vars(p.parse_args(argv))
    values.pop("config")
    values["override"] = values["override"] or []
    try:
        return Args(**values)
    except ArgError as error:
        p.error(str(error))


def given(argv: list[str] | None = None) -> frozenset[str]:
    """The settings `argv` sets itself, on the command line or in its `--config` file (what a
    `--resume` must not contradict), as Args field names."""
    namespace, _ = parser(defaults=False).parse_known_args(argv)
    names = set(vars(namespace)) - {"config"}
    if getattr(namespace, "config", None):
        names |= set(_read_config_file(namespace.config))
    return frozenset(names)
