"""Train a transformer from the zoo, top to bottom (in the spirit of nanoGPT's train.py).

    python train.py                          # a small GPT on the stdlib's own source, no download
    python train.py --model tiny-llama --override vocab_size=4096 --data corpus.jsonl
    python train.py --resume runs/default --steps 800     # continue a run exactly
    python train.py --model tiny-moe --override vocab_size=2048   # MoE: logs expert load
    python train.py --mesh fsdp=4,tensor=2 --rules fsdp_tp        # sharded over 8 devices
    python train.py --init-from SmolLM2.gguf --data my.jsonl --lr 3e-5   # fine-tune
    python train.py --init-from SmolLM2.gguf --dtype bfloat16 --remat full  # bf16 compute
    python train.py --help                   # every setting; --config FILE sets them from a file

Every run writes `metrics.jsonl`, `checkpoints/` and `loss.png` into its run directory, prints
the predicted (zoo.math roofline) next to the measured step time, and logs loss, tokens/s, step
time, data-wait time and MFU.
"""

import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from tqdm import tqdm

from data import packing
from data.corpus import write_stdlib_corpus
from data.datasets import load_text, tokenize
from data.prefetch import Prefetcher
from data.tokenizers import OPENAI_ENCODINGS, get_tokenizer, save_ranks
from shard.xla_flags import set_default_xla_flags
from training import checkpoint
from training.args import Args, parse_args
from training.model_config import DEFAULT_MODEL, check_fits, imported_changes, preset_config
from training.optimizer import adamw, learning_rate
from training.placement import Placement
from training.step import compile_steps, split_model
from training.telemetry import Telemetry, compiled_memory_bytes, hardware
from zoo import Transformer, with_runtime


def say(message: str) -> None:
    tqdm.write(message, file=sys.stdout)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    p = np.bincount(tokens.ravel()).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def init_tokenizer_spec(path: str) -> str:
    """The tokenizer that comes with --init-from: a pretrained checkpoint's own, or the one a
    train.py run recorded (as `checkpoint.tokenizer_from_spec` reads it)."""
    if not checkpoint.is_run(path):
        return str(Path(path).resolve())
    spec = checkpoint.run_tokenizer_spec(path)
    if spec is None:
        raise ValueError(f"--init-from {path!r}: the run records no tokenizer; pass --tokenizer")
    return spec


def load_data(args: Args):
    """Tokenizer, training batches, fixed validation batches and the unigram entropy."""
    cache = Path(args.cache_dir).expanduser()
    spec = str(write_stdlib_corpus(cache)) if args.data == "stdlib" else args.data
    dataset = load_text(spec, column=args.text_column, streaming=args.streaming)
    if args.streaming:
        dataset = dataset.shuffle(seed=args.seed, buffer_size=1000)
        n_val = args.eval_batches * args.batch_size  # documents held out from the stream's head
        val_docs, train_docs = dataset.take(n_val), dataset.skip(n_val)
        sample = [d[args.text_column] for d in dataset.take(2000)]
    else:
        train_idx, val_idx = packing.split_documents(len(dataset), args.val_fraction, args.seed)
        train_docs, val_docs = dataset.select(train_idx), dataset.select(val_idx)
        sample = train_docs[args.text_column]
    if args.init_from and args.tokenizer == "bpe":
        encoding = checkpoint.tokenizer_from_spec(init_tokenizer_spec(args.init_from))
    else:
        encoding = get_tokenizer(
            args.tokenizer, texts=sample, vocab_size=args.vocab_size, cache_dir=cache, log=say
        )
    eot = encoding.eot_token

    def ids(docs):
        return (d["ids"] for d in tokenize(docs, encoding, column=args.text_column))

    val_tokens, val_segments = packing.pack(ids(val_docs), args.seq_len, eot)
    val = packing.Batches(
        val_tokens, val_segments, min(args.batch_size, len(val_tokens)), args.seed
    )
    if args.streaming:
        train = packing.StreamBatches(lambda: ids(train_docs), args.seq_len, eot, args.batch_size)
        entropy = unigram_entropy(val_tokens)
    else:
        tokens, segments = packing.pack(ids(train_docs), args.seq_len, eot)
        train = packing.Batches(tokens, segments, args.batch_size, args.seed)
        entropy = unigram_entropy(tokens)
        say(
            f"data: {tokens.size:,} training tokens in {len(tokens):,} rows, "
            f"{val_tokens.size:,} held out"
        )
    return encoding, train, val.in_order(args.eval_batches), entropy


def evaluate(eval_fn, params, batches) -> float:
    totals = [eval_fn(params, b) for b in batches]
    return float(sum(t[0] for t in totals) / sum(t[1] for t in totals))


def moe_line(moe) -> str:
    """Per-expert share of the token->expert assignments (averaged over MoE layers; 1/n each
    when balanced) and the fraction of assignments dropped by capacity dispatch."""
    load = np.asarray(moe.expert_load).mean(axis=0)
    dropped = float(np.asarray(moe.dropped_fraction).mean())
    return f"expert load [{' '.join(f'{x:.2f}' for x in load)}] | dropped {dropped:.1%}"


def build_model(args: Args, placement: Placement, n_vocab: int, key) -> tuple[Transformer, str]:
    """(model in its placement, its name): a pretrained checkpoint or a train.py run's latest
    checkpoint under this run's run-time settings (weights in --param-dtype), or a fresh
    preset."""
    if args.init_from:
        if checkpoint.is_run(args.init_from):
            model = checkpoint.run_model(args.init_from)
        else:
            from zoo import load_pretrained  # needs the `checkpoints` extra (safetensors, gguf)

            model = load_pretrained(args.init_from, dtype=args.param_dtype)
        model = with_runtime(model, **imported_changes(args, model.config))
        check_fits(model.config, args, n_vocab, args.init_from)
        return placement.place_model(model), args.init_from
    config = preset_config(args, n_vocab)
    return placement.init_model(config, jax.random.fold_in(key, 0)), args.model or DEFAULT_MODEL


def record_tokenizer(args, encoding, run_dir: Path) -> None:
    """Leave the run's tokenizer in the run directory, so `checkpoint.load_run` (and
    `examples/sample.py --run`) decode with the same one: a trained or rank-file BPE as a rank
    file, an OpenAI encoding name or the --init-from tokenizer (`init_tokenizer_spec`) as text."""
    if args.init_from and args.tokenizer == "bpe":
        (run_dir / "tokenizer.source").write_text(init_tokenizer_spec(args.init_from))
    elif args.tokenizer in OPENAI_ENCODINGS:
        (run_dir / "tokenizer.source").write_text(args.tokenizer)
    else:
        save_ranks(encoding, run_dir / "tokenizer.tiktoken")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    placement = Placement.from_flags(args.mesh, args.rules)  # a bad mesh fails before any work
    run_dir = Path(args.resume or args.out)
    if args.resume:
        checkpoint.latest(run_dir)  # fail before loading data when there is nothing to resume
    if args.init_from and Path(args.init_from).resolve() == run_dir.resolve():
        raise ValueError(
            f"--init-from {args.init_from!r} is this run's own directory: --init-from starts a "
            "new run from it (give another --out), --resume continues it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    encoding, train_data, val_batches, entropy = load_data(args)
    record_tokenizer(args, encoding, run_dir)
    say(
        f"tokenizer: {encoding.name}, {encoding.n_vocab} tokens; unigram entropy {entropy:.3f} nats"
    )

    key = jax.random.key(args.seed)
    model, name = build_model(args, placement, encoding.n_vocab, key)
    config = model.config
    params, static = split_model(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    say(
        f"model: {name}, {n_params / 1e6:.2f}M parameters, compute {config.dtype}, on "
        f"{placement.describe()}"
    )
    schedule = learning_rate(
        args.schedule,
        peak=args.lr,
        steps=args.steps,
        warmup=args.warmup,
        min_ratio=args.min_lr_ratio,
    )
    optimizer = adamw(schedule, weight_decay=args.weight_decay, clip=args.clip)
    opt_state = placement.init_opt_state(optimizer, model)
    start, position, rng = 0, 0, key
    if args.resume:
        restored = checkpoint.restore(run_dir, params=params, opt_state=opt_state, config=config)
        shardings = placement.shardings(optimizer, model)
        params, opt_state = placement.put(
            (restored.params, restored.opt_state), shardings and shardings[:2]
        )
        start, position, rng = restored.step, restored.data_position, restored.rng
        say(f"resumed from {restored.path} at step {start}")

    train_fn, eval_fn = compile_steps(
        static, optimizer, args.grad_accum, placement=placement, model=model
    )
    del model  # its arrays are `params`, which the step donates
    val_batches = [placement.batch(b) for b in val_batches]
    hw = hardware(args.peak_flops, args.peak_bandwidth, config.dtype)
    telemetry = Telemetry(run_dir, config, args.batch_size, args.seq_len, hw, accum=args.grad_accum)
    summary = {"val_loss": None, "initial_val_loss": None}
    if args.init_from and not args.resume:
        val_loss = evaluate(eval_fn, params, val_batches)
        telemetry.log(step=0, val_loss=val_loss)
        say(f"step     0 | validation loss {val_loss:.4f} (the pretrained starting point)")
        summary["initial_val_loss"] = val_loss
    batches = Prefetcher(train_data.iterate(position), placement.batch)
    bar = tqdm(total=args.steps, initial=start, disable=not args.progress, desc="train")
    window, window_wait, first_log = [], batches.wait_s, True
    try:
        for step in range(start + 1, args.steps + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            if step == start + 1:  # compile ahead of time, to print its memory beside zoo.math's
                train_fn = train_fn.lower(params, opt_state, batch).compile()
                say(telemetry.memory_line(compiled_memory_bytes(train_fn), placement.devices))
            params, opt_state, metrics = train_fn(params, opt_state, batch)
            loss, grad_norm = float(metrics.loss), float(metrics.grad_norm)
            step_s = time.perf_counter() - t0
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                last = checkpoint.checkpoints(run_dir)
                raise FloatingPointError(
                    f"loss {loss} / gradient norm {grad_norm} at step {step} is not finite: "
                    f"stopping. The last good checkpoint is kept: "
                    f"{last[-1] if last else 'none written yet'}. Try a lower --lr or --clip."
                )
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            moe = {}
            if config.n_experts:
                moe = {
                    "aux_loss": float(metrics.aux_loss),
                    "expert_load": np.asarray(metrics.moe.expert_load).tolist(),
                    "dropped_fraction": np.asarray(metrics.moe.dropped_fraction).tolist(),
                }
                summary["moe"] = metrics.moe
            if step == start + 1:
                # The first step's loss is the starting point (e.g. the pretrained model's).
                telemetry.log(step=step, loss=loss, grad_norm=grad_norm, **moe)
                say(f"step {step}: loss {loss:.4f}; compile + first step took {step_s:.1f} s")
            else:
                window.append(step_s)
            if (step % args.log_every == 0 or step == args.steps) and window:
                step_time = float(np.median(window))
                wait = (batches.wait_s - window_wait) / len(window)
                if first_log:
                    say(telemetry.predicted_line(step_time))
                    first_log = False
                record = telemetry.log(
                    step=step,
                    loss=loss,
                    grad_norm=grad_norm,
                    lr=float(schedule(step - 1)),
                    step_s=step_time,
                    data_wait_s=wait,
                    tokens_per_s=telemetry.tokens_per_step / step_time,
                    mfu=telemetry.mfu(step_time),
                    **moe,
                )
                say(
                    f"step {step:5d} | loss {loss:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
                    f"{step_time * 1e3:.0f} ms/step | data wait {wait * 1e3:.2f} ms | "
                    f"MFU {record['mfu']:.1%}"
                )
                if config.n_experts:
                    say(f"           | aux loss {moe['aux_loss']:.4f} | {moe_line(metrics.moe)}")
                summary.update(record)
                window, window_wait = [], batches.wait_s
            if step % args.eval_every == 0 or step == args.steps:
                val_loss = evaluate(eval_fn, params, val_batches)
                telemetry.log(step=step, val_loss=val_loss)
                say(
                    f"step {step:5d} | validation loss {val_loss:.4f} "
                    f"(unigram entropy {entropy:.3f})"
                )
                summary["val_loss"] = val_loss
            if step % args.checkpoint_every == 0 or step == args.steps:
                checkpoint.save(
                    run_dir,
                    params=params,
                    opt_state=opt_state,
                    step=step,
                    data_position=position + step - start,
                    rng=rng,
                    config=config,
                    keep=args.keep,
                )
            summary.update(step=step, loss=loss)
    finally:
        batches.close()
        bar.close()
    plot = telemetry.plot(run_dir / "loss.png", entropy)
    summary.update(
        unigram_entropy=entropy,
        run_dir=str(run_dir),
        params=eqx.combine(params, static),
        encoding=encoding,
    )
    if summary["val_loss"] is not None:
        say(
            f"done: validation loss {summary['val_loss']:.3f} nats vs unigram entropy "
            f"{entropy:.3f} nats; metrics in {telemetry.path}, loss curve in {plot}"
        )
    return summary


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
