"""Any model artifact, named one way everywhere: a zoo preset name (random weights), an HF model
directory, a GGUF file or a train.py run directory (a full or a LoRA run), each optionally with a
PEFT adapter on top, loaded as (model, tokenizer); and a model written back as a complete HF
directory (weights, config, tokenizer files, generation config).

Every command of the CLI that takes a model takes `--model SPEC [--adapter DIR]` and reads it
here, so a fine-tuned run, a merged export and a downloaded checkpoint are interchangeable.
"""

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax

from shard import Placement
from training import run_dir as runs
from training.run_model import run_model, run_tokenizer
from zoo import Config, Tokenizer, Transformer, preset, presets
from zoo.adapter import has_lora, merge_adapter
from zoo.quantize import dequantize_base, quantized_formats

KINDS = ("preset", "hf", "gguf", "run")
WHAT = (
    "a zoo preset name, an HF model directory (config.json + model.safetensors), a .gguf file "
    "or a train.py run directory (run.json + checkpoints/)"
)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A loaded model, its tokenizer (None for a preset, or a directory without one), what kind
    of artifact it came from (`KINDS`) and where."""

    model: Transformer
    tokenizer: Tokenizer | None
    kind: str
    source: str

    def describe(self) -> str:
        adapters = ", with LoRA adapters" if has_lora(self.model) else ""
        return f"{self.source} ({self.kind}{adapters})"


def artifact_kind(spec: str, *, flag: str | None = "--model") -> str:
    """Which of `KINDS` `spec` names; an error saying what it is not, and what is expected
    (naming `spec` as the argument of `flag`, or alone with None)."""
    path, named = Path(spec), f"{flag} {spec!r}" if flag else repr(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"{named}: the GGUF file does not exist")
        return "gguf"
    if path.is_dir():
        if (path / runs.RECORD).is_file() or runs.is_run(path):
            return "run"
        if (path / "config.json").is_file():
            return "hf"
        if (path / "adapter_config.json").is_file():
            raise ValueError(
                f"{named} is a PEFT adapter, not a model: give its base with --model "
                f"and this directory with --adapter {spec}"
            )
        raise ValueError(f"{named} is a directory but none of: {WHAT}")
    if spec in presets():
        return "preset"
    raise ValueError(f"{named} is none of: {WHAT}; presets: {', '.join(presets())}")


def artifact_config(spec: str) -> Config:
    """The architecture `spec` names, read without its weights: a preset's config, an HF
    directory's config.json, a GGUF file's metadata, a run's latest checkpoint's record."""
    kind = artifact_kind(spec)
    if kind == "preset":
        return preset(spec)
    if kind == "run":
        return runs.checkpoint_config(spec)[0]
    from zoo.pretrained import gguf
    from zoo.pretrained.hf_config import config_from_hf, read_hf_config

    hf = gguf.hf_config(gguf.open_gguf(spec)) if kind == "gguf" else read_hf_config(spec)
    return config_from_hf(hf)[1]


def load_artifact(
    spec: str,
    *,
    adapter: str | None = None,
    attention: str | None = None,
    placement: Placement | None = None,
    chat_template: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Artifact:
    """The model and tokenizer `spec` names (`artifact_kind`), with the PEFT adapter in
    `adapter` added, under the attention kernel `attention` (default: the one that serves the
    model, `zoo.Policy`), the chat template `chat_template` (a file or Jinja text) instead of its
    own. Weights go straight into `placement`'s shardings. `log` hears what is being done."""
    kind = artifact_kind(spec)
    placement = placement or Placement()
    start = time.perf_counter()
    log(f"loading {spec} ({kind}) ...")
    if kind == "preset":
        config = preset(spec)
        model = placement.init(lambda key: Transformer(config, key=key), jax.random.key(seed))
        tokenizer = None
    elif kind == "run":
        model = run_model(spec, placement=placement)
        tokenizer = run_tokenizer(spec)
    else:
        from zoo import load_pretrained, load_tokenizer

        model = load_pretrained(spec, placement=placement)
        has_tokenizer = kind == "gguf" or (Path(spec) / "tokenizer.json").is_file()
        tokenizer = load_tokenizer(spec) if has_tokenizer else None
    if adapter is not None:
        model = with_adapter(model, adapter, spec, placement)
    if attention is not None:
        model = model.with_policy(attention=attention)
    if chat_template is not None:
        tokenizer = _with_template(tokenizer, chat_template, spec)
    log(f"loaded {spec} in {time.perf_counter() - start:.1f} s: {_summary(model)}")
    return Artifact(model, tokenizer, kind, spec)


def _summary(model: Transformer) -> str:
    from zoo import math as zmath

    c = model.config
    adapters = " + LoRA adapters" if has_lora(model) else ""
    packed = quantized_formats(model)
    weights = f"{', '.join(packed)} blocks, else " if packed else ""
    return (
        f"{zmath.param_count(c) / 1e6:.1f}M parameters{adapters}, {c.n_layers} layers, vocab "
        f"{c.vocab_size}, {weights}{model.policy.param_dtype}, attention "
        f"{model.policy.kernel_name}"
    )


def with_adapter(model: Transformer, adapter: str, spec: str, placement: Placement):
    from zoo import load_adapter

    if has_lora(model):
        raise ValueError(
            f"--adapter {adapter!r}: --model {spec!r} already holds LoRA adapters (a LoRA run); "
            "give its base with --model instead, or drop --adapter"
        )
    return load_adapter(model, adapter, placement=placement)


def _with_template(tokenizer: Tokenizer | None, template: str, spec: str) -> Tokenizer:
    from zoo.tokenizer.chat import compile_template
    from zoo.tokenizer.load import read_chat_template

    if tokenizer is None:
        raise ValueError(
            f"--chat-template: --model {spec!r} comes with no tokenizer to apply it to"
        )
    source = read_chat_template(template)
    compile_template(source)
    return dataclasses.replace(tokenizer, chat_template=source)


def plain(model: Transformer) -> Transformer:
    """`model` with its LoRA adapters folded into its weights (a quantized base dequantized
    first): the plain model an HF directory holds."""
    if not has_lora(model):
        return model
    return merge_adapter(dequantize_base(model))


def export(
    artifact: Artifact,
    directory: str | Path,
    *,
    overwrite: bool = False,
    architecture: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write `artifact` as a complete HF model directory: adapters merged, quantized blocks (a
    GGUF's, `zoo.quantize`'s) written as the float weights they stand for, config, tokenizer
    files with the chat template, generation config. An artifact without a tokenizer
    is refused before anything is written."""
    from zoo import save_pretrained

    if artifact.tokenizer is None:
        raise ValueError(
            f"{artifact.source!r} comes with no tokenizer, and an HF directory needs one: export "
            "a checkpoint or a run that has one"
        )
    model = plain(artifact.model)
    if has_lora(artifact.model):
        log("merged the LoRA adapters into the weights: W + (alpha / rank) A B")
    packed = quantized_formats(model)
    if packed:
        log(
            f"writing the float weights the quantized blocks ({', '.join(packed)}) stand for, in "
            f"{model.policy.param_dtype}: an HF directory holds no packed blocks"
        )
    start = time.perf_counter()
    save_pretrained(
        model, directory, tokenizer=artifact.tokenizer, overwrite=overwrite,
        architecture=architecture, dequantize=bool(packed),
    )  # fmt: skip
    files = sorted(p.name for p in Path(directory).iterdir())
    log(f"wrote {directory} in {time.perf_counter() - start:.1f} s: {', '.join(files)}")
    return Path(directory)
