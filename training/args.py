"""Everything a run can be told, as one typed dataclass, and the CLI built from it.

Each field's type gives the flag's parser (a `Literal` gives choices, a bool gives
`--x/--no-x`), its `help` metadata the text in `--help`. `--config FILE` (JSON or TOML, keys
named like the fields) sets defaults that flags on the command line override.
"""

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal


def _help(text: str, **kwargs):
    return dataclasses.field(metadata={"help": text}, **kwargs)


@dataclasses.dataclass(kw_only=True)
class Args:
    model: str | None = _help(
        "preset name from zoo.presets (or see --override); default gpt-mini, none with --init-from",
        default=None,
    )
    override: list[str] = _help(  # noqa: RUF009 (a field() with help text)
        "change a Config field of the preset, FIELD=VALUE (repeatable), e.g. n_layers=2; with "
        "--init-from only the run-time fields (zoo.RUNTIME_FIELDS)",
        default_factory=list,
    )
    data: str = _help(
        "'stdlib' (the embedded corpus), a local text/json/jsonl/parquet/csv file or directory, "
        "or a Hugging Face hub dataset name (online only)",
        default="stdlib",
    )
    text_column: str = _help("column holding the documents' text", default="text")
    streaming: bool = _help("stream the dataset instead of loading it whole", default=False)
    tokenizer: str = _help(
        "'bpe' (byte-level BPE trained on --data, cached), an OpenAI encoding name (gpt2, "
        "cl100k_base, ...) or a .tiktoken rank file",
        default="bpe",
    )
    vocab_size: int = _help("tokens in a --tokenizer bpe vocabulary", default=2048)
    steps: int = _help("optimizer steps in all", default=300)
    batch_size: int = _help("sequences per optimizer step", default=16)
    grad_accum: int = _help("micro-batches per step (gradient accumulation)", default=1)
    seq_len: int = _help("tokens per sequence", default=128)
    lr: float = _help("peak learning rate", default=3e-3)
    min_lr_ratio: float = _help("final learning rate as a fraction of --lr", default=0.1)
    warmup: int = _help("linear warm-up steps", default=30)
    schedule: Literal["cosine", "wsd"] = _help(
        "after warm-up: cosine decay, or WSD (warmup-stable-decay)", default="cosine"
    )
    weight_decay: float = _help("AdamW decoupled weight decay (matrices only)", default=0.1)
    clip: float = _help("clip gradients to this global norm (0: off)", default=1.0)
    dtype: Literal["float32", "bfloat16", "float16"] = _help("compute dtype", default="float32")
    param_dtype: Literal["float32", "bfloat16", "float16"] = _help(
        "dtype of the stored weights and so of the optimizer state (float32 master weights)",
        default="float32",
    )
    remat: Literal["none", "full", "dots"] = _help(
        "rematerialisation policy of each block", default="none"
    )
    attention: Literal["naive", "xla", "flash"] | None = _help(
        "attention kernel (default: the preset's)", default=None
    )
    out: str = _help("run directory: metrics, checkpoints, loss curve", default="runs/default")
    resume: str | None = _help(
        "continue the run in this directory from its latest checkpoint", default=None
    )
    init_from: str | None = _help(
        "start from a pretrained checkpoint (HF directory or .gguf) or a train.py run directory "
        "(its latest checkpoint) for fine-tuning: the architecture and the tokenizer (with "
        "--tokenizer bpe) come from it, the optimizer starts afresh; the run-time "
        "settings (--dtype, --param-dtype, --remat, --attention, run-time --override) apply",
        default=None,
    )
    mesh: str | None = _help(
        "shard over a device mesh, e.g. fsdp=4,tensor=2 (axes data, fsdp, tensor, expert; the "
        "sizes must multiply to the device count). Default: one device",
        default=None,
    )
    rules: Literal["dp", "fsdp", "tp", "fsdp_tp", "ep"] | None = _help(
        "sharding preset for --mesh (default: the one the mesh's shape suggests)", default=None
    )
    eval_every: int = _help("evaluate on held-out data every N steps", default=100)
    eval_batches: int = _help("held-out batches per evaluation", default=8)
    val_fraction: float = _help("fraction of documents held out for validation", default=0.05)
    log_every: int = _help("log a metrics line every N steps", default=25)
    checkpoint_every: int = _help("write a checkpoint every N steps", default=200)
    keep: int = _help("checkpoints to keep", default=3)
    seed: int = _help("seed for initialisation and data order", default=0)
    cache_dir: str = _help(
        "cache for the stdlib corpus and trained tokenizers", default="~/.cache/eqx-zoo"
    )
    peak_flops: float = _help(
        "device peak FLOP/s for MFU (0: datasheet or measured at start-up)", default=0.0
    )
    peak_bandwidth: float = _help("device bandwidth in bytes/s (with --peak-flops)", default=0.0)
    progress: bool = _help("show a progress bar", default=True)


def _flag_type(tp):
    """(argparse kwargs) for a field type."""
    origin, params = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (tp,) = [p for p in params if p is not type(None)]
        return _flag_type(tp)
    if typing.get_origin(tp) is Literal:
        return {"choices": typing.get_args(tp)}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is list:
        return {"action": "append"}
    return {"type": tp}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a transformer from eqx-zoo. With no flags: a small GPT on the Python "
        "standard library's own source code (no download).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="JSON or TOML file of settings (flags override it)")
    for field in dataclasses.fields(Args):
        default = field.default_factory() if callable(field.default_factory) else field.default
        kwargs = _flag_type(field.type)
        p.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            default=None if kwargs.get("action") == "append" else default,
            help=field.metadata["help"],
            **kwargs,
        )
    return p


def _read_config_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path!r} does not exist")
    text = file.read_text()
    values = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    names = {f.name for f in dataclasses.fields(Args)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"--config {path!r}: unknown settings {unknown}; known: {sorted(names)}")
    return values


def parse_args(argv: list[str] | None = None) -> Args:
    p = parser()
    namespace, _ = p.parse_known_args(argv)
    if namespace.config:
        p.set_defaults(**_read_config_file(namespace.config))
    values = vars(p.parse_args(argv))
    values.pop("config")
    values["override"] = values["override"] or []
    return Args(**values)
