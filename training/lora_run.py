"""LoRA fine-tuning in a train.py run: the adapter flags (`--lora-rank`, `--lora-alpha`,
`--lora-targets`, `--base-dtype`) applied to the model a run starts from, and the fingerprint of
the base checkpoint.

A LoRA run's checkpoints hold the adapters and their optimizer state alone (what `split_model`
calls trainable); the base is the `--init-from` checkpoint, re-read on `--resume` and by
training/run_model.py. Its SHA-256, recorded when the run starts, is checked each time it is
re-read, so a base that changed under the run is an error rather than an adapter applied to
weights it was not trained on.
"""

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from shard import Placement
from training import run_dir as runs
from training.args import lora_target_names
from training.state import checkpoint_files
from zoo import Config, Policy, Transformer, add_lora, quantize_base
from zoo import math as zmath

QUANTIZED = ("int8", "nf4")
NF4_BLOCK = 64  # QLoRA's block size, made smaller where a projection's input dim needs it


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What `adapt` reads: the run's `--lora-rank`, `--lora-alpha`, `--lora-targets` and
    `--base-dtype`, from its `Args` or from the settings its run.json recorded."""

    rank: int
    alpha: float
    targets: str
    base_dtype: str | None

    @staticmethod
    def of(settings: Mapping[str, Any]) -> "LoraSettings":
        return LoraSettings(
            rank=settings["lora_rank"],
            alpha=settings["lora_alpha"],
            targets=settings["lora_targets"],
            base_dtype=settings["base_dtype"],
        )

    @property
    def quantized(self) -> str | None:
        return self.base_dtype if self.base_dtype in QUANTIZED else None


def nf4_block(config: Config) -> int:
    """QLoRA's 64, or the largest divisor of 64 dividing every projection's inputs where 64 does
    not (groups run along a projection's flattened inputs)."""
    rows_cols = zmath.quantized_matrices(config)["projections"]
    return math.gcd(NF4_BLOCK, *(cols for _, cols in rows_cols))


def adapt(
    model: Transformer, lora: LoraSettings, placement: Placement, key: PRNGKeyArray
) -> Transformer:
    """`model` as the frozen base of a LoRA run: held in `--base-dtype` (cast, or quantized:
    int8 per channel, NF4 in blocks) and wrapped with rank-`--lora-rank` adapters on
    `--lora-targets` (float32, B = 0: the adapted model starts as the base)."""
    if lora.quantized:
        model = quantize_base(model, lora.quantized, block=nf4_block(model.config))
    elif lora.base_dtype is not None:
        dtype = jnp.dtype(lora.base_dtype)
        model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    try:
        return add_lora(
            model, lora_target_names(lora.targets), lora.rank, lora.alpha, placement=placement,
            key=key,
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(f"--lora-targets {lora.targets!r}: {error}") from None


def frozen_bytes(lora: LoraSettings, config: Config, policy: Policy) -> int:
    """zoo.math's bytes of the frozen base `adapt` makes under `policy`."""
    if lora.quantized:
        return zmath.frozen_base_bytes(config, lora.quantized, policy, block=nf4_block(config))
    base = policy.replace(param_dtype=lora.base_dtype or policy.param_dtype)
    return zmath.frozen_base_bytes(config, None, base)


def fingerprint(path: str | Path) -> str:
    """SHA-256 of a base checkpoint's files: a .gguf or safetensors file; an HF directory's
    config and weight files; a train.py run's latest checkpoint (its files, not the SHA-256 record
    written after them)."""
    path = Path(path)
    if runs.is_run(path):
        root = runs.latest(path)
        files = checkpoint_files(root)
    elif path.is_dir():
        root = path
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    else:
        root, files = path.parent, [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root)).encode())
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
