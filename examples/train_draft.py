"""Distil a draft model for speculative decoding from SmolLM2-135M-Instruct (training/draft.py):
the target's first few layers, trained on the target's own replies to chat prompts to predict
its next-token distribution. The draft is written as an HF directory with the target's
tokenizer, for `python -m bench speculative` and `DraftModel(zoo.load_pretrained(out), k=...)`.

    python -m examples.train_draft                      # 4 layers, ~1,240 chat prompts, 5 epochs
    python -m examples.train_draft --layers 2 --epochs 1 --out runs/draft2

Stages (each prints what it did and how long it took):
1. Prompts: each topic of examples/data/topics.txt in six phrasings (tell me about, explain, a
   short essay, a story, ...), plus the user turns of examples/data/*.jsonl. One prompt in 20 is
   held out to measure the draft on text it never saw. (The bench's free-chat prompt, the
   history of tea, is in neither.)
2. Replies: the target's greedy reply to each prompt (what a greedy draft must predict), by the
   serving engine in batches; kept in OUT/replies.jsonl, which a later run reads instead.
3. The target's last hidden state at every token (one forward per batch): its distribution at
   a position is its head on that state, recomputed in each training step.
4. Distillation: AdamW on KL(target || draft) over the reply positions, the embedding frozen;
   the held-out KL and top-1 agreement (the greedy acceptance rate a draft would see) before,
   during and after.
5. The draft's vocabulary (`--draft-vocab`, default 8,192 of 49,152 tokens): the tokens most
   frequent in the training prompts and replies, written beside the draft (draft_vocab.json,
   read by `infer.speculative.draft_vocab`). Its head cut to them, a draft forward reads a
   sixth of the head it had (most of a 4-layer draft's bytes).
"""

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from cli.flags import default_chat_model
from infer import Greedy, generate
from infer.speculative.draft import DRAFT_VOCAB
from shard.xla_flags import set_default_xla_flags
from training import draft as distill
from training.optimizer import adamw, learning_rate

DATA = Path(__file__).parent / "data"
SPLITS = ("train", "held-out")
PHRASINGS = (
    "Tell me about {}.",
    "Tell me about {} in a few paragraphs.",
    "Explain {} to a ten-year-old.",
    "Write a short essay on {}.",
    "What are the most interesting facts about {}?",
    "Write a short story that involves {}.",
)


def prompts() -> list[str]:
    """Every user turn the example distils on (module docstring, stage 1)."""
    topics = (DATA / "topics.txt").read_text().split("\n")
    texts = [p.format(t) for t in topics if t for p in PHRASINGS]
    for name in ("chat.jsonl", "preferences.jsonl", "brevity_heldout.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            row = json.loads(line)
            if "prompt" in row:
                texts.append(row["prompt"])
            else:
                texts += [m["content"] for m in row["messages"] if m["role"] == "user"]
    for line in (DATA / "questions.jsonl").read_text().splitlines():
        texts.append(json.loads(line)["text"].split(" Answer:")[0].removeprefix("Question: "))
    return sorted(set(texts))


def replies(target, tokenizer, texts: list[str], args, path: Path) -> list[dict]:
    """The target's greedy reply to each text, read from `path` when a run wrote it."""
    done = {}
    if path.exists():
        done = {row["prompt"]: row for row in map(json.loads, path.read_text().splitlines())}
    todo = [t for t in texts if t not in done]
    started = time.perf_counter()
    with path.open("a") as out:
        for i in range(0, len(todo), args.gen_batch):
            batch = todo[i : i + args.gen_batch]
            tokens = [
                tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                              add_generation_prompt=True)
                for t in batch
            ]  # fmt: skip
            new = generate(
                target, tokens, max_new_tokens=args.new_tokens, sampler=Greedy(),
                key=jax.random.key(args.seed), tokenizer=tokenizer,
            )  # fmt: skip
            for text, prompt, reply in zip(batch, tokens, new, strict=True):
                done[text] = {"prompt": text, "tokens": prompt + reply, "prompt_len": len(prompt)}
                out.write(json.dumps(done[text]) + "\n")
            out.flush()
            made = sum(len(r) for r in new)
            print(f"  replies {i + len(batch)}/{len(todo)} ({made} tokens, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return [done[t] for t in texts]


def hidden_states(target, tokens: np.ndarray, segments: np.ndarray, batch: int) -> np.ndarray:
    """The target's last hidden state at every token, a batch at a time."""
    parts = [
        np.asarray(distill.target_hidden(target, tokens[i : i + batch], segments[i : i + batch]))
        for i in range(0, len(tokens), batch)
    ]
    return np.concatenate(parts)


def packed(target, rows: list[dict], held_out: set[str], args, path: Path) -> dict:
    """The training and held-out rows (tokens, segments, counted, the target's hidden states),
    read from `path` when a run with the same prompts and length wrote it."""
    prompts_hash = hashlib.sha256("\n".join(r["prompt"] for r in rows).encode()).hexdigest()
    key = np.asarray([prompts_hash, str(args.seq_len)])
    if path.exists():
        saved = np.load(path)
        if np.array_equal(saved["key"], key):
            return {name: tuple(saved[f"{name}/{i}"] for i in range(4)) for name in SPLITS}
    started, split = time.perf_counter(), {}
    for name in SPLITS:
        chosen = [(r["tokens"], r["prompt_len"]) for r in rows
                  if (r["prompt"] in held_out) == (name == "held-out")]  # fmt: skip
        tokens, segments, counted = distill.pack(chosen, args.seq_len)
        hidden = hidden_states(target, tokens, segments, args.batch_size)
        split[name] = (tokens, segments, counted, hidden)
    arrays = {f"{name}/{i}": a for name, parts in split.items() for i, a in enumerate(parts)}
    np.savez(path, key=key, **arrays)
    print(f"target hidden states: {sum(len(s[0]) for s in split.values())} rows of "
          f"{args.seq_len} tokens, {int(split['train'][2].sum())} training positions "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return split


def batches(arrays, size: int, rng: np.random.Generator):
    """One epoch of `size`-row batches of `arrays` in a random order (the last partial one
    dropped: one compiled shape)."""
    order = rng.permutation(len(arrays[0]))
    for i in range(0, len(order) - size + 1, size):
        rows = order[i : i + size]
        yield distill.DistillBatch(*(jnp.asarray(a[rows]) for a in arrays))


def evaluate(draft, target, arrays, size: int) -> tuple[float, float]:
    """Held-out KL and agreement, weighted by each batch's counted positions."""
    kl = agree = total = 0.0
    for i in range(0, len(arrays[0]), size):
        batch = distill.DistillBatch(*(jnp.asarray(a[i : i + size]) for a in arrays))
        metrics, count = distill.distill_eval(draft, target, batch), float(batch.counted.sum())
        kl, agree, total = (
            kl + float(metrics.kl) * count,
            agree + float(metrics.agreement) * count,
            total + count,
        )
    return kl / total, agree / total


def write_vocabulary(rows, held_out: set[str], size: int, vocab_size: int, path: Path) -> None:
    """The vocabulary of the training rows, written beside the draft (`DRAFT_VOCAB`), with the
    share of held-out reply tokens it holds (a missed token is a rejected draft)."""
    training = [r["tokens"] for r in rows if r["prompt"] not in held_out]
    vocab = distill.draft_vocabulary(training, size, vocab_size)
    (path / DRAFT_VOCAB).write_text(json.dumps(vocab))
    chosen = set(vocab)
    replies = [t for r in rows if r["prompt"] in held_out for t in r["tokens"][r["prompt_len"] :]]
    covered = sum(t in chosen for t in replies) / max(len(replies), 1)
    print(f"draft vocabulary: {len(vocab)} of {vocab_size} tokens ({path / DRAFT_VOCAB}), "
          f"{covered:.3f} of the held-out replies' tokens")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.train_draft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, default=4, help="the draft's layers (the target's first)")
    p.add_argument("--new-tokens", type=int, default=160, help="tokens per reply at most")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    p.add_argument("--gen-batch", type=int, default=16, help="replies generated at once")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per training step")
    p.add_argument("--epochs", type=int, default=5, help="passes over the replies")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (cosine decay)")
    p.add_argument("--compute-dtype", default="bfloat16", help="training's products")
    p.add_argument("--limit", type=int, default=None, help="use only this many prompts")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="tokens the draft may propose (its head cut to them; 0: every token)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/draft", help="directory of the replies and the draft")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = args.model or default_chat_model()
    target = zoo.load_pretrained(model_path, quantized=False)
    tokenizer = zoo.load_tokenizer(model_path)
    texts = prompts()
    random.Random(args.seed).shuffle(texts)
    texts = texts[: args.limit]
    held_out = set(texts[::20])
    print(f"{len(texts)} prompts ({len(held_out)} held out); replies by the target ...", flush=True)
    rows = replies(target, tokenizer, texts, args, out / "replies.jsonl")
    split = packed(target, rows, held_out, args, out / "hidden.npz")

    # Mixed precision: float32 weights and optimizer, bfloat16 products (~1.4x a step here);
    # the KL is taken in float32 (training/draft.py).
    draft = distill.draft_init(target, args.layers).with_policy(compute_dtype=args.compute_dtype)
    target = target.with_policy(compute_dtype=args.compute_dtype)
    steps = args.epochs * (len(split["train"][0]) // args.batch_size)
    optimizer = adamw(learning_rate("cosine", peak=args.lr, steps=steps, warmup=steps // 20),
                      weight_decay=0.0)  # fmt: skip
    opt_state = distill.init_optimizer(draft, optimizer)
    kl, agree = evaluate(draft, target, split["held-out"], args.batch_size)
    print(f"held-out before: KL {kl:.3f} nats, top-1 agreement {agree:.3f}", flush=True)
    rng, step, started = np.random.default_rng(args.seed), 0, time.perf_counter()
    for epoch in range(args.epochs):
        for batch in batches(split["train"], args.batch_size, rng):
            draft, opt_state, metrics = distill.distill_step(
                draft, opt_state, target, batch, optimizer
            )
            step += 1
            if step % 50 == 0 or step == steps:
                print(f"  step {step}/{steps}: KL {float(metrics.kl):.3f}, agreement "
                      f"{float(metrics.agreement):.3f} ({time.perf_counter() - started:.0f} s)",
                      flush=True)  # fmt: skip
        kl, agree = evaluate(draft, target, split["held-out"], args.batch_size)
        print(f"held-out after epoch {epoch + 1}: KL {kl:.3f} nats, top-1 agreement {agree:.3f}",
              flush=True)  # fmt: skip
    draft = draft.with_policy(storage="unrolled", compute_dtype="float32")
    zoo.save_pretrained(draft, out / "model", tokenizer=tokenizer, overwrite=True)
    print(f"draft written to {out / 'model'} ({args.layers} layers)")
    if args.draft_vocab:
        write_vocabulary(rows, held_out, args.draft_vocab, target.config.vocab_size, out / "model")
    return draft


if __name__ == "__main__":
    set_default_xla_flags()
    main()
