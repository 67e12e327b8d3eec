"""Sampling one token per row from `[batch, vocab]` logits: the previous top-p (a full argsort
per row, `infer.sampling.top_p_by_sort`) against the sort-free threshold search of
`infer.sample`, with top-k and greedy (argmax) beside them.

    python -m bench sampling

Vocab 49152 (SmolLM2) and 128256 (Llama 3), batch 1 and 32, float32 logits. There is nothing to
predict but bytes: every sampler must read the logits once, so predicted = batch x vocab x 4 bytes
/ the measured bandwidth; the threshold search reads them about 32 times per filter (one masked
sum per bisection step), the argsort many more. Every sampled row also draws one Gumbel number
per logit (`jax.random.categorical`, threefry): "temperature only" times that draw alone.
"""

import jax

from bench.harness import Ceilings, Table, median_seconds, roofline_cells
from infer.sampling import (
    Greedy,
    Temperature,
    TopK,
    TopP,
    sample,
    stack_samplers,
    top_p_by_sort,
)

VOCABS = (49152, 128256)
BATCHES = (1, 32)
P, K, TEMPERATURE = 0.9, 50, 0.8
REPEATS = 5


@jax.jit
def _argsort_top_p(logits, key):
    return jax.random.categorical(key, top_p_by_sort(logits / TEMPERATURE, P), axis=-1)


def run(ceilings: Ceilings) -> Table:
    bandwidth = ceilings.bandwidth()
    table = Table(
        "sampling",
        "Sampling (float32 logits): argsort top-p vs threshold search",
        [
            f"Ceiling: bandwidth {bandwidth / 1e9:.3g} GB/s measured in this run; predicted = "
            "one read of the logits / ceiling; achieved GB/s counts that one read. top-p "
            f"p={P}, top-k k={K}, temperature {TEMPERATURE}."
        ],
    )
    key = jax.random.key(0)
    for vocab in VOCABS:
        for batch in BATCHES:
            logits = jax.random.normal(jax.random.key(1), (batch, vocab)) * 3.0
            n_bytes = logits.nbytes
            runs = {"argsort top-p (previous)": lambda logits=logits: _argsort_top_p(logits, key)}
            for name, sampler in [
                ("search top-p", TopP(P, temperature=TEMPERATURE)),
                ("search top-k", TopK(K, temperature=TEMPERATURE)),
                ("temperature only (the draw)", Temperature(TEMPERATURE)),
                ("greedy", Greedy()),
            ]:
                params = stack_samplers([sampler] * batch)
                runs[name] = lambda logits=logits, params=params: sample(logits, params, key)
            baseline = None
            for name, fn in runs.items():
                seconds = median_seconds(fn, repeats=REPEATS)
                baseline = baseline or seconds
                row = {"vocab": vocab, "batch": batch, "sampler": name}
                cells = roofline_cells(n_bytes / bandwidth, seconds, n_bytes, bandwidth, "GB/s")
                table.add(row | cells | {"vs argsort": baseline / seconds})
    return table
