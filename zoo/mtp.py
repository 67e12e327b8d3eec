"""DeepSeek-V3's multi-token-prediction (MTP) module (DeepSeek-AI 2024, arXiv 2412.19437,
section 2.2): trained to predict the token after next, so at inference it drafts for the
model itself (speculative decoding, infer/speculative/mtp.py).

At position `i`, from the main model's final hidden state `h_i` (after its final norm: what its
LM head reads) and the next token `t_{i+1}`:

    h'_i = Block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]))
    logits_{i+2} = head(norm(h'_i))

`[a; b]` is concatenation on the feature axis, embedding first: the checkpoints' `eh_proj` is
laid out so (vLLM's and SGLang's DeepSeek MTP layers read it that way; the paper's equation 21
writes the two in the other order). `Block` is a decoder layer of the main model's kind (for
V3, an MLA + MoE layer) with its own causal attention over the positions before `i`: its own KV
cache. Drafting further, the module's own `h'` stands in for `h` (vLLM's drafting loop).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from layers import Linear, RMSNorm
from layers.kv_cache import KVCache
from zoo.block import make_norm
from zoo.config import Config
from zoo.output import ModelOutput
from zoo.policy import Policy
from zoo.transformer import DEFAULT_POLICY, HeadRows, Transformer


def body_config(config: Config) -> Config:
    """The main model's config for the module's one block: an MoE layer when the layer after
    the main model's last would be one (DeepSeek-V3's layer 61), a dense one otherwise."""
    moe = config.n_experts > 0 and config.n_layers >= config.first_dense_layers
    if moe:
        return dataclasses.replace(config, n_layers=1, first_dense_layers=0, moe_every=1)
    return dataclasses.replace(config, n_layers=1, first_dense_layers=0, n_experts=0)


class MTP(eqx.Module):
    """One MTP module (module docstring). `body` is a one-layer Transformer holding the
    module's token table (`embed_tokens`), its block, its `shared_head.norm` (`final_norm`)
    and `shared_head.head` (`lm_head`); `embed_norm`, `hidden_norm` and `proj` are `enorm`,
    `hnorm` and `eh_proj` (`[2 * d_model] -> [d_model]`)."""

    embed_norm: RMSNorm
    hidden_norm: RMSNorm
    proj: Linear
    body: Transformer

    def __init__(self, config: Config, *, policy: Policy = DEFAULT_POLICY, key: PRNGKeyArray):
        body_key, proj_key = jax.random.split(key)
        if config.norm != "rmsnorm":
            raise ValueError(
                f"an MTP module normalises with RMSNorm (DeepSeek-V3), got a {config.norm} model"
            )
        self.body = Transformer(body_config(config), policy=policy, key=body_key)
        dtype = self.body.policy.params
        self.embed_norm, self.hidden_norm = make_norm(config, dtype), make_norm(config, dtype)
        d = config.d_model
        self.proj = Linear(2 * d, d, axes=("mlp", "embed"), dtype=dtype, key=proj_key)

    def inputs(
        self, tokens: Int[Array, "batch seq"], hidden: Float[Array, "batch seq embed"]
    ) -> Float[Array, "batch seq embed"]:
        """The block's input: `eh_proj([enorm(emb(t)); hnorm(h)])`."""
        embedded = self.embed_norm(self.body.embed_tokens(tokens))
        hidden = self.hidden_norm(hidden.astype(embedded.dtype))
        return self.proj(jnp.concatenate([embedded, hidden], axis=-1))

    def forward(
        self,
        tokens: Int[Array, "batch seq"],
        hidden: Float[Array, "batch seq embed"],
        *,
        cache: KVCache | None = None,
        valid: Bool[Array, "batch seq"] | None = None,
        logits_at: Int[Array, " n"] | None = None,
        head: HeadRows | None = None,
    ) -> ModelOutput:
        """At each position `i`: `tokens` the next tokens `t_{i+1}`, `hidden` the main model's
        final hidden states `h_i` after its final norm (or this module's own `h'` when drafting
        further). Logits of `t_{i+2}`, and `hidden` this module's `h'` (before its norm); the
        cache, `valid`, `logits_at` and `head` as `Transformer.forward` takes them."""
        return self.body.forward(
            tokens, embeddings=self.inputs(tokens, hidden), cache=cache, valid=valid,
            logits_at=logits_at, head=head,
        )  # fmt: skip

    def with_policy(self, policy: Policy) -> "MTP":
        """The same weights under the main model's new policy (`Transformer.with_policy`)."""
        return eqx.tree_at(lambda m: m.body, self, self.body.with_policy(policy))
