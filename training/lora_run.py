"""LoRA fine-tuning in a train.py run: the adapter flags (`--lora-rank`, `--lora-alpha`,
`--lora-targets`, `--base-dtype`) applied to the model a run starts from, and the fingerprint of
the base checkpoint.

A LoRA run's checkpoints hold the adapters and their optimizer state alone (what `split_model`
calls trainable); the base is the `--init-from` checkpoint, re-read on `--resume` and by
`run_dir.run_model`. Its SHA-256, recorded when the run starts, is checked each time it is re-read,
so a base that changed under the run is an error rather than an adapter applied to weights it was
not trained on.
"""

import hashlib
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from shard import Placement
from training import run_dir as runs
from training.args import Args
from zoo import Config, Transformer, add_lora, quantize_base

QUANTIZED = ("int8", "nf4")
# The settings `adapt` reads (a LoRA run records them; `run_dir.run_model` rebuilds from them).
SETTINGS = ("lora_rank", "lora_alpha", "lora_targets", "base_dtype")
NF4_BLOCK = 64  # QLoRA's block size, made smaller where a projection's input dim needs it


def targets(args: Args) -> tuple[str, ...]:
    return tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())


def nf4_block(config: Config) -> int:
    """QLoRA's 64, or the largest divisor of 64 dividing every projection's last input dim
    (d_model, d_ff, head_dim) where 64 does not."""
    c = config
    return math.gcd(NF4_BLOCK, c.d_model, c.head_dim, *([c.d_ff] if c.d_ff else []))


def adapt(model: Transformer, args: Args, placement: Placement, key: PRNGKeyArray) -> Transformer:
    """`model` as the frozen base of a LoRA run: held in `--base-dtype` (cast, or quantized:
    int8 per channel, NF4 in blocks) and wrapped with rank-`--lora-rank` adapters on
    `--lora-targets` (float32, B = 0: the adapted model starts as the base)."""
    if args.base_dtype in QUANTIZED:
        block = nf4_block(model.config) if args.base_dtype == "nf4" else NF4_BLOCK
        model = quantize_base(model, args.base_dtype, block=block)
    elif args.base_dtype is not None:
        dtype = jnp.dtype(args.base_dtype)
        model = jax.tree.map(
            lambda x: x.astype(dtype) if isinstance(x, jax.Array) and jnp.issubdtype(
                x.dtype, jnp.floating) else x,
            model,
        )  # fmt: skip
    try:
        return add_lora(
            model, targets(args), args.lora_rank, args.lora_alpha, placement=placement, key=key
        )
    except ValueError as error:
        raise ValueError(f"--lora-targets {args.lora_targets!r}: {error}") from None


def fingerprint(path: str | Path) -> str:
    """SHA-256 of a base checkpoint's files: a .gguf or safetensors file; an HF directory's
    config and weight files; a train.py run's latest checkpoint."""
    path = Path(path)
    if runs.is_run(path):
        files = sorted(runs.latest(path).iterdir())
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    else:
        files = [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def check_base(recorded: dict, run_dir: Path) -> None:
    """The base a LoRA run recorded ({"path", "sha256"}) is still the one on disk."""
    path = recorded["path"]
    if not Path(path).exists():
        raise ValueError(
            f"{str(run_dir)!r} is a LoRA run on the base {path!r}, which no longer exists: its "
            "checkpoints hold the adapters alone; put the base back at that path"
        )
    found = fingerprint(path)
    if found != recorded["sha256"]:
        raise ValueError(
            f"{str(run_dir)!r} is a LoRA run on the base {path!r}, whose files changed since the "
            f"run started (SHA-256 {found[:12]}... now, {recorded['sha256'][:12]}... recorded): "
            "the adapters were trained on the old weights; restore them or start a new run"
        )
