"""Compose a model in Python and train it with the same pieces train.py uses (~30 lines): a
2-layer model on 1 MB of the standard library's source, 200 steps (about 30 s on a 2-core CPU).

    python -m examples.train_tiny
    python -m examples.train_tiny --steps 1000     # longer
"""

import argparse

import jax

from data import packing
from data.corpus import write_stdlib_corpus
from data.datasets import load_text, tokenize
from data.prefetch import Prefetcher
from data.tokenizers import cached_bpe
from shard import Placement
from training.args import POSITIVE_INT
from training.optimizer import adamw, learning_rate
from training.step import compile_steps, split_model
from zoo import Config, Transformer


def main(steps: int) -> float:
    docs = load_text(str(write_stdlib_corpus("runs/cache", max_bytes=1_000_000)))
    encoding = cached_bpe(docs["text"], 512, "runs/cache")
    ids = (d["ids"] for d in tokenize(docs, encoding))
    tokens, segments = packing.pack(ids, seq_len=64, eot=encoding.eot_token)
    batches = packing.Batches(tokens, segments, batch_size=16, seed=0)

    config = Config(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=64)
    model, devices = Transformer(config, key=jax.random.key(0)), Placement()  # or (mesh, rules)
    params, static = split_model(model)
    optimizer = adamw(learning_rate("wsd", peak=3e-3, steps=steps, warmup=steps // 10))
    opt_state = devices.init_opt_state(optimizer, params)
    train_step, _ = compile_steps(static, optimizer, placement=devices, model=model)

    batched = Prefetcher(batches.iterate(), devices.batch)
    for step, batch in zip(range(1, steps + 1), batched, strict=False):
        params, opt_state, metrics = train_step(params, opt_state, batch)
        if step % 20 == 0 or step == steps:
            print(f"step {step}: loss {float(metrics.loss):.3f}")
    return float(metrics.loss)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=POSITIVE_INT.flag_type(), default=200)
    main(p.parse_args().steps)
