"""Rotary theta and frequency scaling in an HF config.json, read and written for every family:
transformers >= 5 nests both in `rope_parameters` (Gemma 3 once per layer type); older configs
have top-level `rope_theta` and `rope_scaling`. Each family passes the scaling kinds it
implements (and tests); another kind is an error naming the kinds it has."""

from layers.rotary import RopeScaling

_YARN_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
}


def hf_rope_parameters(hf: dict) -> dict:
    """The rope parameters of `hf`, whichever layout it uses: `rope_scaling` wins over
    `rope_parameters` where both are set, as in transformers (`rope_scaling or rope_parameters`),
    so a config whose rope_parameters say "default" next to a scaling is not read unscaled."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(
            f"config.json rope parameters must be an object like {{'rope_type': 'llama3', "
            f"'factor': 8.0, ...}}, not {params!r}"
        )
    return dict(params)


def scaling_from_hf(params: dict, arch: str, kinds: tuple[str, ...]) -> RopeScaling | None:
    """The RopeScaling of one rope-parameters dict (None for HF's "default")."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in kinds:
        raise ValueError(
            f"{arch} rope_type={kind!r} is not supported; the zoo has 'default' and "
            f"{' and '.join(repr(k) for k in kinds)}"
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown or not params.get("truncate", True) or params.get("factor") is None:
        raise ValueError(
            f"{arch} yarn rope parameters {params} are not supported: the zoo implements "
            f"factor (required), original_max_position_embeddings, beta_fast, beta_slow, mscale, "
            f"mscale_all_dim and truncate=True (not {unknown})"
        )
    return RopeScaling(
        kind="yarn",
        factor=float(params["factor"]),
        original_max_seq_len=int(params["original_max_position_embeddings"]),
        # transformers reads a 0 or missing beta as its default (`or 32`, `or 1`).
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def rope_from_hf(
    hf: dict, arch: str, kinds: tuple[str, ...], *, default_theta: float = 10_000.0
) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a config.json with one rotary table."""
    params = hf_rope_parameters(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    return theta, scaling_from_hf(params, arch, kinds)


def rope_to_hf(theta: float, scaling: RopeScaling | None) -> dict:
    """The `rope_parameters` dict transformers reads for (theta, scaling)."""
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is None:
        return params
    s = scaling
    if s.kind == "linear":
        return params | {"rope_type": "linear", "factor": s.factor}
    if s.kind == "llama3":
        return params | {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return params | {
        "rope_type": "yarn",
        "factor": s.factor,
        "original_max_position_embeddings": s.original_max_seq_len,
        "beta_fast": s.beta_fast,
        "beta_slow": s.beta_slow,
        "mscale": s.mscale,
        "mscale_all_dim": s.mscale_all_dim,
    }
