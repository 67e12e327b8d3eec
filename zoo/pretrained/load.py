"""`load_pretrained`: an HF model directory or a .gguf file -> a Transformer with its weights."""

import os

from shard import Placement
from zoo.policy import Policy
from zoo.pretrained import deepseek_mtp, gguf
from zoo.pretrained.deepseek_mtp import load_checkpoint_mtp
from zoo.pretrained.fill import load_weights
from zoo.pretrained.hf_config import config_from_hf, declared_dtype, read_hf_config
from zoo.pretrained.safetensors import SafetensorsSource
from zoo.transformer import Transformer


def load_pretrained(
    path: str | os.PathLike,
    *,
    policy: Policy | None = None,
    placement: Placement | None = None,
    quantized: bool | None = None,
) -> Transformer:
    """The model stored at `path`: an HF directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json) or a `.gguf` file of a llama.cpp architecture in
    `gguf.ARCHITECTURES` (llama, qwen2, qwen3, phi3, gemma2, gemma3).

    The architecture and sizes always come from the checkpoint; how the model runs is `policy`,
    by default `Policy.inference`: the fastest decode (its layer storage by backend, dtype and
    `placement`: `zoo.policy.decode_storage`), computing and storing in the dtype config.json
    declares (float32 if none), float32 for GGUF. Training takes stacked layers: pass a policy
    with `storage="stacked"` (train.py does). Weights are
    read one tensor group at a time (no second copy of the checkpoint is held) and each goes
    straight into its sharding under `placement` (`shard.Placement(mesh, rules)`) as it is read.

    A DeepSeek-V3 checkpoint's multi-token-prediction module (its layer `num_hidden_layers`)
    becomes `model.mtp` (zoo/mtp.py: a self-drafter for speculative decoding), None where it has
    none.

    A GGUF's quantized projections and token table stay in their blocks (`quantized`, default:
    on one device) as packed weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: layers/quantized), which
    decode reads 4 to 6x fewer bytes of than float32 and which the quantized kernels multiply
    without a float copy (bench/RESULTS.md), stacked where every layer has the same block types
    and the policy stacks (else one array per layer); another quantized type
    is an error naming it. `quantized=False` dequantizes every tensor to float32 instead (a
    model to fine-tune, or to shard over a mesh whose axes do not divide the blocks).
    """
    placement = placement or Placement()
    path = os.fspath(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist")
        reader = gguf.open_gguf(path)
        hf = gguf.hf_config(reader)
        arch, config = config_from_hf(hf)
        policy = policy or Policy.inference(
            "float32", sharded=placement.sharded, experts=config.n_experts > 0
        )
        source = gguf.GGUFSource(reader, hf)
        keep = not placement.sharded if quantized is None else quantized
        return load_weights(
            source, arch, config, policy=policy, placement=placement, quantized=keep
        )
    if quantized:
        raise ValueError(
            f"quantized=True keeps a GGUF file's quantized blocks, and {path!r} is not a .gguf "
            "file; quantize a float model with zoo.quantize(model, 'int8' | 'int4' | 'nf4')"
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"{path!r} is neither an HF model directory nor a .gguf file; pass a directory with "
            "config.json and model.safetensors, or a path ending in .gguf"
        )
    hf = read_hf_config(path)
    arch, config = config_from_hf(hf)
    policy = policy or Policy.inference(
        declared_dtype(hf), sharded=placement.sharded, experts=config.n_experts > 0
    )
    source = SafetensorsSource(path)
    model = load_weights(source, arch, config, policy=policy, placement=placement)
    if arch.name == deepseek_mtp.ARCHITECTURE:
        model = load_checkpoint_mtp(source, arch, model, hf, policy=policy, placement=placement)
    return model
