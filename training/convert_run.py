"""Convert a train.py run directory written before orbax (Equinox-format checkpoints:
`step_XXXXXXXX/state.eqx` + `meta.json`) to today's orbax checkpoints, in place:

    python -m training.convert_run runs/default

Each old checkpoint is checked against the SHA-256 its meta.json recorded, read into the
structure the run's record defines (its model config, its optimizer's clipping, its LoRA
adapters) and written with orbax into `checkpoints.orbax/`; only when every one is written does
that directory replace `checkpoints/` (the old one is deleted last), so a failure midway leaves
the run as it was. One process; the arrays pass through the host, as the old format did.
"""

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from shard import Placement
from training import run_dir as runs
from training import run_model
from training.checkpoint_metadata import META_READS, check_run_meta
from training.optimizer import adamw
from training.state import LEGACY_STATE, Writer
from zoo import Config, Policy
from zoo.adapter import split_trainable
from zoo.json_file import field, read_json_object

LEGACY_META = "meta.json"


def _legacy_meta(path: Path) -> dict:
    """A legacy checkpoint's meta.json, with the fields conversion needs (else an error naming
    the file and the field)."""
    file = path / LEGACY_META
    if not file.is_file():
        raise ValueError(f"{path} has {LEGACY_STATE} but no {LEGACY_META}; it cannot be converted")
    meta = read_json_object(file, "the checkpoint's config, param_dtype and sha256")
    field(meta, "sha256", str, str(file))
    # What an orbax checkpoint's meta holds (checkpoint_metadata.META_READS), and only that.
    return check_run_meta({k: meta[k] for k in META_READS if k in meta}, str(file)) | {
        "sha256": meta["sha256"]
    }


def _read_legacy(path: Path, template):
    meta = _legacy_meta(path)
    digest = hashlib.sha256((path / LEGACY_STATE).read_bytes()).hexdigest()
    if digest != meta.pop("sha256", None):
        raise ValueError(
            f"{path / LEGACY_STATE} does not match the SHA-256 in its {LEGACY_META}: it is "
            "damaged; delete that checkpoint (the run keeps the others) and convert again"
        )
    try:
        return eqx.tree_deserialise_leaves(path / LEGACY_STATE, template), meta
    except Exception as error:
        raise ValueError(
            f"{path / LEGACY_STATE} matches its SHA-256 but does not hold this run's state "
            f"({type(error).__name__}: {error}); it was not written by train.py for this run"
        ) from error


def convert(run_dir: str | Path) -> list[Path]:
    """Rewrite every Equinox-format checkpoint of `run_dir` with orbax; the new step dirs."""
    run_dir = Path(run_dir)
    old = [p for p in runs.checkpoints(run_dir) if (p / LEGACY_STATE).is_file()]
    if not old:
        raise ValueError(f"{str(run_dir)!r} holds no Equinox-format checkpoint to convert")
    settings = runs.read_record(run_dir)["settings"]
    meta = _legacy_meta(old[-1])
    config = Config.from_dict(meta["config"], source=f"{old[-1] / LEGACY_META}")
    policy = Policy(param_dtype=meta["param_dtype"], compute_dtype=meta["param_dtype"])
    if settings.get("lora_rank"):
        model = run_model.lora_model(run_dir, policy, Placement())
    else:
        model = runs.abstract_model(config, policy)
    trainable = split_trainable(model)[0]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
    # The state's structure depends on whether the run clipped, not on the schedule's values.
    optimizer = adamw(lambda _: 0.0, weight_decay=settings["weight_decay"], clip=settings["clip"])
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    template = (params, jax.eval_shape(optimizer.init, params), key_data)

    staging = run_dir / "checkpoints.orbax"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with Writer(staging, keep=0, asynchronous=False) as writer:
            for path in old:
                (params, opt_state, key_data), meta = _read_legacy(path, template)
                trees = {"params": params, "opt_state": opt_state, "rng": {"key_data": key_data}}
                writer.save(meta["step"], jax.tree.map(np.asarray, trees), meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # the run stays exactly as it was
        raise
    kept = run_dir / "checkpoints.eqx-old"
    (run_dir / "checkpoints").rename(kept)
    staging.rename(run_dir / "checkpoints")
    shutil.rmtree(kept)
    return runs.checkpoints(run_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a train.py --out directory with state.eqx checkpoints")
    args = parser.parse_args(argv)
    for path in convert(args.run_dir):
        print(f"converted {path}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as error:
        sys.exit(f"convert_run: error: {error}")
