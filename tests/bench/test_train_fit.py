"""bench/train.py's choice of remat policy and batch: zoo.math ranks, the compiler confirms."""

import pytest

import zoo
from bench.train import candidates, compile_step, fit_step

CONFIG = zoo.preset("tiny-llama", n_layers=2)
POLICY = zoo.Policy()


def test_candidates_fit_the_estimate_and_prefer_less_recomputation():
    budget = zoo.math.training_memory_bytes(CONFIG, 16, 64, POLICY.replace(remat="none")) * 1.01
    pairs = candidates(CONFIG, POLICY, 64, budget)
    assert pairs[0] == ("none", 16)
    assert all(
        zoo.math.training_memory_bytes(CONFIG, b, 64, POLICY.replace(remat=r)) <= budget
        for r, b in pairs
    )


def test_fit_step_takes_the_first_candidate_whose_compiled_step_fits():
    # At this budget zoo.math's favourite (no remat, batch 32) needs more than 90% of it once
    # compiled: the check must reject it and take the next candidate that does fit.
    budget = 50e6
    policy, batch, _, needed = fit_step(CONFIG, POLICY, 64, budget)
    pairs = candidates(CONFIG, POLICY, 64, 0.9 * budget)
    chosen = pairs.index((policy.remat, batch))
    assert chosen > 0 and needed <= 0.9 * budget
    for remat, b in pairs[:chosen]:
        assert compile_step(CONFIG, POLICY.replace(remat=remat), b, 64)[1] > 0.9 * budget


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_memory_estimate_is_close_to_the_compiled_steps(remat):
    # zoo.math counts what each block saves; XLA's buffer assignment is the measurement.
    config = zoo.preset(
        "tiny-llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=704,
        vocab_size=2048, max_seq_len=512,
    )  # fmt: skip
    policy = zoo.Policy(attention="xla", remat=remat)
    predicted = zoo.math.training_memory_bytes(config, 4, 512, policy)
    compiled = compile_step(config, policy, 4, 512)[1]
    assert 0.8 < compiled / predicted < 1.4
