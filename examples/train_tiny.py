"""Compose a model in Python and train it with the same pieces train.py uses (~30 lines).

python examples/train_tiny.py
"""

import jax

from data import packing
from data.corpus import write_stdlib_corpus
from data.datasets import load_text, tokenize
from data.prefetch import Prefetcher
from data.tokenizers import cached_bpe
from shard import Placement
from training.optimizer import adamw, learning_rate
from training.step import compile_steps, split_model
from zoo import Config, Transformer

docs = load_text(str(write_stdlib_corpus("runs/cache", max_bytes=1_000_000)))
encoding = cached_bpe(docs["text"], 512, "runs/cache")
ids = (d["ids"] for d in tokenize(docs, encoding))
tokens, segments = packing.pack(ids, seq_len=64, eot=encoding.eot_token)
batches = packing.Batches(tokens, segments, batch_size=16, seed=0)

config = Config(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=64)
model, devices = Transformer(config, key=jax.random.key(0)), Placement()  # or (mesh, rules)
params, static = split_model(model)
optimizer = adamw(learning_rate("wsd", peak=3e-3, steps=200, warmup=20))
opt_state = devices.init_opt_state(optimizer, params)
train_step, _ = compile_steps(static, optimizer, placement=devices, model=model)

for step, batch in zip(range(1, 201), Prefetcher(batches.iterate(), devices.batch), strict=False):
    params, opt_state, metrics = train_step(params, opt_state, batch)
    if step % 20 == 0:
        print(f"step {step}: loss {float(metrics.loss):.3f}")
