"""bench/train.py's choice of remat policy and batch: zoo.math ranks, the compiler confirms."""

import zoo
from bench.train import candidates, compile_step, fit_step

CONFIG = zoo.preset("tiny-llama", n_layers=2)


def test_candidates_fit_the_estimate_and_prefer_less_recomputation():
    budget = zoo.math.training_memory_bytes(CONFIG, 16, 64, remat="none") * 1.01
    pairs = candidates(CONFIG, 64, budget)
    assert pairs[0] == ("none", 16)
    assert all(zoo.math.training_memory_bytes(CONFIG, b, 64, remat=r) <= budget for r, b in pairs)


def test_fit_step_returns_a_step_the_compiler_says_fits():
    # A budget between the compiled sizes of the first two candidates: the estimate's favourite
    # does not fit once compiled, so the next one is compiled and chosen.
    pairs = candidates(CONFIG, 64, 1e12)
    sizes = [compile_step(CONFIG.replace(remat=r), b, 64)[1] for r, b in pairs[:2]]
    budget = (max(sizes) + min(sizes)) / 2 / 0.9
    config, batch, _, needed = fit_step(CONFIG, 64, budget)
    assert needed <= 0.9 * budget
    assert (config.remat, batch) == pairs[sizes.index(min(sizes))]
