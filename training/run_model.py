"""The model and tokenizer a train.py run trained, rebuilt from its run directory: the latest
checkpoint's parameters on the architecture it records, a LoRA run's adapters on the base it
recorded (re-read and checked against its fingerprint), and the tokenizer the run used.

One module rebuilds a run's model, above both training/run_dir.py (checkpoints, records) and
training/lora_run.py (adapters, fingerprints), so neither imports the other's caller.
"""

from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from shard import Placement
from shard.axes import is_float_array_like
from training import lora_run
from training import run_dir as runs
from training.state import CorruptState, MismatchedState, restore_state
from zoo import Config, Policy, Tokenizer, Transformer
from zoo.adapter import split_trainable


def is_lora_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` trained LoRA adapters on a frozen base (its checkpoints hold them)."""
    recorded = (Path(run_dir) / runs.RECORD).is_file()
    return recorded and bool(runs.read_record(run_dir)["settings"].get("lora_rank"))


def lora_model(run_dir: str | Path, policy: Policy, placement: Placement) -> Transformer:
    """A LoRA run's model before its trained adapters are read: the base it recorded (checked
    against its fingerprint), or its preset re-created from its seed, under `policy`, with fresh
    adapters."""
    from zoo import load_pretrained  # needs the `checkpoints` extra (safetensors, gguf)

    record = runs.read_record(run_dir)
    settings = record["settings"]
    key = jax.random.key(settings["seed"])
    if settings.get("init_from"):
        lora_run.check_base(record["base"], Path(run_dir))
        source = record["base"]["path"]
        if runs.is_run(source):
            base = run_model(source, policy=policy, placement=placement)
        else:
            base = load_pretrained(source, policy=policy, placement=placement, quantized=False)
    else:
        config = Config.from_dict(record["config"], source=f"{run_dir}/{runs.RECORD}")
        make = lambda k: Transformer(config, policy=policy, key=k)  # noqa: E731
        base = placement.init(make, jax.random.fold_in(key, 0))
    lora = lora_run.LoraSettings.of(settings)
    return lora_run.adapt(base, lora, placement, jax.random.fold_in(key, 1))


def run_model(
    run_dir: str | Path, *, policy: Policy | None = None, placement: Placement | None = None
) -> Transformer:
    """The Transformer of the latest checkpoint with its trained parameters, straight into
    `placement`'s shardings (the optimizer state is not read). `policy` defaults to the run's
    parameter dtype; a different `param_dtype` casts the weights after reading. A LoRA run's
    model is its base with the trained adapters (`zoo.merge_adapter` folds them in)."""
    config, param_dtype = runs.checkpoint_config(run_dir)
    stored = Policy(param_dtype=param_dtype, compute_dtype=param_dtype)
    placement = placement or Placement()
    if is_lora_run(run_dir):
        params, static = split_trainable(lora_model(run_dir, stored, placement))
        params = runs.shapes_of(params)
    else:
        params, static = eqx.partition(runs.abstract_model(config, stored), is_float_array_like)
    path = runs.latest(run_dir)
    template = runs.placed(params, placement.param_shardings(params), placement)
    try:
        params = restore_state(path, {"params": template})["params"]  # not the optimizer state
    except (CorruptState, MismatchedState) as error:
        raise ValueError(f"checkpoint {path} is corrupt ({error}); delete it") from error
    model = eqx.combine(params, static)
    return model if policy is None else model.with_policy(policy)


def run_tokenizer(run_dir: str | Path, spec: str | None = None) -> Tokenizer | None:
    """The run's tokenizer as a `zoo.Tokenizer` (`spec`, else the one it recorded: a
    checkpoint's own with its chat template, or a BPE it trained or an OpenAI encoding, which
    have none); None when the run records none."""
    from zoo.tokenizer import from_tiktoken

    spec = spec or runs.run_tokenizer_spec(run_dir)
    if spec is None:
        return None
    tokenizer = runs.chat_tokenizer_from_spec(spec)
    return tokenizer if isinstance(tokenizer, Tokenizer) else from_tiktoken(tokenizer)


def load_run(
    run_dir: str | Path,
    *,
    tokenizer: str | None = None,
    policy: Policy | None = None,
    placement: Placement | None = None,
) -> tuple[Transformer, Any]:
    """(model, tokenizer) of a run directory written by train.py, for inference: `run_model`
    and `run_tokenizer` (`tokenizer`: an OpenAI encoding name, a `.tiktoken` rank file or a
    checkpoint, instead of the one the run recorded)."""
    model = run_model(run_dir, policy=policy, placement=placement)
    return model, run_tokenizer(run_dir, tokenizer)
