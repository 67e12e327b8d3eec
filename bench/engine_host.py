"""The serving engine's host cost per decode step: where a step's wall time goes when every row
decodes, split into the host's Python (scheduling, the plan, reading the previous step's tokens,
streaming), the calls of the step's two compiled programs, forward and sampling (arguments,
copies to the device, the launch of their kernels) and the wait for the previous step's tokens,
beside the same programs called alone, back to back (the step's cost once the host keeps up).

    python -m bench engine-host

Models: a tiny Llama of 2 and of 16 layers (width 32, float32: the device work is next to
nothing, so what is left is the host's), and on a GPU llama3-1b in bfloat16; 1 and 8 rows,
each row holding 25-300 tokens. Predicted: the host's Python well below the program's own time,
so the device never waits for it (the host runs one step behind: it builds and launches step
k+1 before it reads step k's tokens); the engine's step = the program alone.
"""

import statistics
import time

import jax

import zoo
from bench.harness import Ceilings, Table, on_gpu
from infer.engine import Engine

STEPS, WARM_STEPS = 200, 15


def _models() -> dict[str, zoo.Transformer]:
    tiny = dict(d_model=32, d_ff=64, vocab_size=256, max_seq_len=512)
    configs = {f"tiny-llama, {n} layers": zoo.preset("tiny-llama", n_layers=n, **tiny)
               for n in (2, 16)}  # fmt: skip
    dtype = {name: "float32" for name in configs}
    if on_gpu():
        configs["llama3-1b"], dtype["llama3-1b"] = zoo.preset("llama3-1b"), "bfloat16"
    key = jax.random.key(0)
    return {
        name: zoo.Transformer(config, policy=zoo.Policy.inference(dtype[name]), key=key)
        for name, config in configs.items()
    }


def _timed_engine(model, rows: int) -> tuple[Engine, dict[str, float]]:
    """An engine whose program calls and waits for tokens add up in the returned dict."""
    engine = Engine(model, max_batch=rows, max_len=512, prefix_sharing=False)
    spent = {"call": 0.0, "wait": 0.0}
    compiled, consume = engine._compiled, engine._consume

    def timed(program):
        def call(*args):
            start = time.perf_counter()
            out = program(*args)
            spent["call"] += time.perf_counter() - start
            return out

        return call

    def timed_compiled(plan):
        return tuple(timed(program) for program in compiled(plan))

    def timed_consume(launched):
        start = time.perf_counter()
        launched.report.block_until_ready()
        spent["wait"] += time.perf_counter() - start
        consume(launched)

    engine._compiled, engine._consume = timed_compiled, timed_consume
    return engine, spent


def _split(model, rows: int) -> dict[str, float]:
    """Median ms per decode step: the whole `engine.step()`, its parts, the program alone."""
    engine, spent = _timed_engine(model, rows)
    for i in range(rows):
        engine.submit([(7 * i + j) % 200 + 1 for j in range(25)], max_new_tokens=STEPS + 60)
    for _ in range(WARM_STEPS):
        engine.step()
    parts = {"step": [], "python": [], "call": [], "wait": []}
    for _ in range(STEPS):
        spent["call"] = spent["wait"] = 0.0
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        parts["step"].append(step)
        parts["call"].append(spent["call"])
        parts["wait"].append(spent["wait"])
        parts["python"].append(step - spent["call"] - spent["wait"])
    medians = {name: 1e3 * statistics.median(values) for name, values in parts.items()}
    medians["alone"] = _alone_ms(engine)
    return medians


def _alone_ms(engine: Engine) -> float:
    """The engine's decode-only programs (forward, then sampling) on its running rows' plan,
    launched back to back."""
    plan = engine._plan([r for r in engine.rows if r is not None], [], 0)
    for _ in range(WARM_STEPS):
        report, _ = engine._launch(plan, [])
    report.block_until_ready()
    start = time.perf_counter()
    for _ in range(STEPS):
        report, _ = engine._launch(plan, [])
    report.block_until_ready()
    return 1e3 * (time.perf_counter() - start) / STEPS


def run(ceilings: Ceilings) -> Table:
    del ceilings  # host time: no roofline
    table = Table(
        "engine-host",
        "The engine's host cost per decode step (every row decoding)",
        [
            "Median ms of `engine.step()` split into the host's Python, the step programs' "
            "calls and the wait for the previous step's tokens; 'alone': the compiled programs "
            f"called back to back on the same rows. {STEPS} steps after {WARM_STEPS}. "
            "Predicted: Python well below the programs' time, so step = alone."
        ],
    )
    for name, model in _models().items():
        for rows in (1, 8):
            ms = _split(model, rows)
            table.add({
                "model": name, "rows": rows, "step ms": ms["step"], "python ms": ms["python"],
                "call ms": ms["call"], "wait ms": ms["wait"], "alone ms": ms["alone"],
                "step / alone": ms["step"] / ms["alone"],
            })  # fmt: skip
    return table
