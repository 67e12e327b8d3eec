"""Distil a draft model for speculative decoding from SmolLM2-135M-Instruct (training/draft.py):
the target's first few layers, trained on the target's own replies to chat prompts to predict
its next-token distribution. The draft is written as an HF directory with the target's
tokenizer, for `python -m bench speculative` and `DraftModel(zoo.load_pretrained(out), k=...)`.

    python -m examples.train_draft                      # 4 layers, ~1,240 chat prompts, 5 epochs
    python -m examples.train_draft --layers 2 --epochs 1 --out runs/draft2
    python -m examples.train_draft --mtp                # a one-layer MTP module, 10 epochs

`--mtp` trains a multi-token-prediction module for the target instead (training/mtp.py: one
layer that reads the target's hidden state as well as the tokens, EAGLE's recipe on DeepSeek-V3's
module), on the same replies and hidden states, with both heads cut to the draft vocabulary;
it is written to OUT/mtp/mtp.safetensors (`zoo.save_mtp`; `zoo.load_mtp(target, path)` and
`MTPDraft(k, vocab=draft_vocab(OUT/mtp))` draft with it) with the vocabulary beside it.

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
   during and after (with `--mtp`, of the module's first and second drafts).
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
from infer.speculative.draft import DRAFT_VOCAB, head_rows
from infer.speculative.mtp import MTP_FILE
from shard.xla_flags import set_default_xla_flags
from training import draft as distill
from training import mtp as mtp_training
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


def evaluate(run, arrays, size: int) -> dict[str, float]:
    """Each held-out metric of `run(batch)`, weighted by the batches' counted positions."""
    sums, total = {}, 0.0
    for i in range(0, len(arrays[0]), size):
        batch = distill.DistillBatch(*(jnp.asarray(a[i : i + size]) for a in arrays))
        metrics, count = run(batch), float(batch.counted.sum())
        for name, value in vars(metrics).items():
            sums[name] = sums.get(name, 0.0) + float(value) * count
        total += count
    return {name: value / total for name, value in sums.items()}


def described(values: dict) -> str:
    return ", ".join(f"{name} {float(value):.3f}" for name, value in values.items())


def training_steps(split, args) -> int:
    return args.epochs * (len(split["train"][0]) // args.batch_size)


def fit(params, opt_state, step, run_eval, split, args, what: str):
    """`args.epochs` passes of `step(params, opt_state, batch)` over the training rows, with the
    held-out metrics (`run_eval(params, batch)`) before and after each."""
    steps = training_steps(split, args)

    def held_out(params):
        return described(
            evaluate(lambda b: run_eval(params, b), split["held-out"], args.batch_size)
        )

    print(f"held-out before: {held_out(params)}", flush=True)
    rng, done, started = np.random.default_rng(args.seed), 0, time.perf_counter()
    for epoch in range(args.epochs):
        for batch in batches(split["train"], args.batch_size, rng):
            params, opt_state, metrics = step(params, opt_state, batch)
            done += 1
            if done % 50 == 0 or done == steps:
                print(f"  {what} step {done}/{steps}: {described(vars(metrics))} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        print(f"held-out after epoch {epoch + 1}: {held_out(params)}", flush=True)
    return params


def optimizer_for(split, args):
    steps = training_steps(split, args)
    schedule = learning_rate("cosine", peak=args.lr, steps=steps, warmup=steps // 20)
    return adamw(schedule, weight_decay=0.0)


def train_draft(target, tokenizer, split, args, out: Path):
    """Stage 4 for a draft model: the target's first layers distilled, written to `out`."""
    # Mixed precision: float32 weights and optimizer, bfloat16 products (~1.4x a step here);
    # the KL is taken in float32 (training/draft.py).
    draft = distill.draft_init(target, args.layers).with_policy(compute_dtype=args.compute_dtype)
    target = target.with_policy(compute_dtype=args.compute_dtype)
    optimizer = optimizer_for(split, args)
    draft = fit(
        draft, distill.init_optimizer(draft, optimizer),
        lambda d, o, b: distill.distill_step(d, o, target, b, optimizer),
        lambda d, b: distill.distill_eval(d, target, b), split, args, "draft",
    )  # fmt: skip
    draft = draft.with_policy(storage="unrolled", compute_dtype="float32")
    zoo.save_pretrained(draft, out, tokenizer=tokenizer, overwrite=True)
    print(f"draft written to {out} ({args.layers} layers)")


def train_mtp(target, split, args, vocab: list[int] | None, out: Path):
    """Stage 4 with `--mtp`: a multi-token-prediction module, written to `out`/mtp.safetensors."""
    target = target.with_policy(compute_dtype=args.compute_dtype)
    mtp = mtp_training.mtp_init(target, jax.random.key(args.seed))
    head = None if vocab is None else head_rows(target, jnp.asarray(vocab, jnp.int32))
    optimizer = optimizer_for(split, args)
    mtp = fit(
        mtp, mtp_training.init_optimizer(mtp, optimizer),
        lambda m, o, b: mtp_training.mtp_step(m, o, target, b, optimizer, head),
        lambda m, b: mtp_training.mtp_eval(m, target, b, head), split, args, "module",
    )  # fmt: skip
    target = target.with_policy(compute_dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    zoo.save_mtp(target.with_mtp(mtp.with_policy(target.policy)), out / MTP_FILE)
    print(f"multi-token-prediction module written to {out / MTP_FILE}")


def vocabulary(rows, held_out: set[str], size: int, vocab_size: int) -> list[int]:
    """The vocabulary of the training rows, with the share of held-out reply tokens it holds
    printed (a missed token is a rejected draft)."""
    training = [r["tokens"] for r in rows if r["prompt"] not in held_out]
    vocab = distill.draft_vocabulary(training, size, vocab_size)
    chosen = set(vocab)
    replies = [t for r in rows if r["prompt"] in held_out for t in r["tokens"][r["prompt_len"] :]]
    covered = sum(t in chosen for t in replies) / max(len(replies), 1)
    print(f"draft vocabulary: {len(vocab)} of {vocab_size} tokens, {covered:.3f} of the held-out "
          "replies' tokens")  # fmt: skip
    return vocab


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.train_draft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, default=4, help="the draft's layers (the target's first)")
    p.add_argument(
        "--mtp",
        action="store_true",
        help="train a one-layer multi-token-prediction module instead of a draft model",
    )
    p.add_argument("--new-tokens", type=int, default=160, help="tokens per reply at most")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    p.add_argument("--gen-batch", type=int, default=16, help="replies generated at once")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per training step (default 4 for a draft, 8 with --mtp)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="passes over the replies (default 5 for a draft, 10 with --mtp)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (cosine decay; default 6e-4 for a draft, 2e-3 with --mtp)",
    )
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
    args = p.parse_args(argv)
    defaults = {"lr": (6e-4, 2e-3), "batch_size": (4, 8), "epochs": (5, 10)}
    for name, (draft, mtp) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, mtp if args.mtp else draft)
    return args


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
    if training_steps(split, args) == 0:
        raise SystemExit(
            f"train_draft: the replies pack into {len(split['train'][0])} training sequences of "
            f"{args.seq_len} tokens, fewer than --batch-size {args.batch_size}: no step would "
            "train anything. Use more prompts (--limit), a smaller --batch-size or a shorter "
            f"--seq-len; the replies are kept in {out / 'replies.jsonl'} and read back."
        )
    size = target.config.vocab_size
    vocab = vocabulary(rows, held_out, args.draft_vocab, size) if args.draft_vocab else None
    where = out / ("mtp" if args.mtp else "model")
    if args.mtp:
        train_mtp(target, split, args, vocab, where)
    else:
        train_draft(target, tokenizer, split, args, where)
    if vocab is not None:
        (where / DRAFT_VOCAB).write_text(json.dumps(vocab))
        print(f"draft vocabulary written to {where / DRAFT_VOCAB}")


if __name__ == "__main__":
    set_default_xla_flags()
    main()
