"""Which config.json fields an architecture understands. Nothing is silently ignored: a field the
zoo does not read and that is not known to leave the model's math alone is an error, and so is a
field the zoo reads only at one value (a feature it does not implement) set to another."""

from collections.abc import Iterable, Mapping
from typing import Any

# Bookkeeping, generation defaults, and training-time regularisers of a model without dropout:
# none of them changes what the weights compute.
HARMLESS = frozenset(
    {
        "_name_or_path",
        "architectures",
        # The remote-code classes a checkpoint ships for older transformers (Phi-3's).
        "auto_map",
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "problem_type",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "use_cache",
        "initializer_range",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "attention_dropout",
        "embd_pdrop",
        "resid_pdrop",
        "attn_pdrop",
        "router_aux_loss_coef",
        "quantization_config",
    }
)


def check_fields(
    hf: dict,
    arch: str,
    *,
    reads: Iterable[str],
    only: Mapping[str, Any] | None = None,
    harmless: Iterable[str] = HARMLESS,
    file: str = "config.json",
) -> None:
    """Refuse what `arch`'s reader of `file` would otherwise ignore.

    `reads`: the fields the reader maps (and checks) itself. `only`: fields it implements at one
    value alone (e.g. `{"use_sliding_window": False}`); another value is an error naming it.
    Any other field outside `harmless` is an error listing every such field."""
    only = dict(only or {})
    for name, value in only.items():
        if name in hf and hf[name] != value:
            raise ValueError(
                f"{arch} {file} sets {name}={hf[name]!r}, which the zoo does not implement "
                f"(only {name}={value!r}); remove it only if the checkpoint was trained without it"
            )
    unknown = sorted(set(hf) - set(harmless) - set(reads) - set(only))
    if unknown:
        raise ValueError(
            f"{arch} {file} has fields the zoo does not implement: {unknown}; they may "
            "change the model's math, so the checkpoint is refused rather than loaded wrong"
        )
