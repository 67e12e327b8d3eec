"""Speculative decoding in the serving engine (infer/speculative/), SmolLM2-135M-Instruct in
float32 (the GGUF dequantized), batch 1, greedy, side by side in one run with the same engine
without speculation:

- prompt lookup (`PromptLookup(k=6)`) on an input-grounded task (repeat a passage word for word)
  and on free chat (where nothing recurs: it should cost little and win nothing), verifying
  every step that has a draft (`adaptive=False`) and adaptive (the engine verifies only in steps
  where the rows' running acceptance and the measured step costs make it pay,
  infer/speculative/adaptive.py);
- a draft model on both: the target's first 2 layers (`truncated_draft`, untrained), k = 2.

Each row prints the acceptance rate (drafts kept / drafts verified), the tokens one target
forward emitted (decode steps only) and the decode speed of both engines (median of interleaved
repeats), beside the prediction of zoo.math: the expected tokens per step at the measured
acceptance rate (`speculative_tokens_per_step`) and the speedup once the verification's cost is
counted (`speculative_speedup`; a `k + 1`-token target step over a one-token one, both by the
roofline of the ceilings measured in this run; an adaptive row's at least 1x), and for adaptive
rows the verification's cost the engine measured itself (in plain steps), which it decides by.
Every speculative run's tokens are checked against the plain engine's.

    python -m bench speculative
"""

import statistics

import zoo
from bench.harness import Ceilings, Table
from cli.flags import default_chat_model as smollm2_gguf
from infer.engine import Engine
from infer.speculative import DraftModel, PromptLookup, truncated_draft
from zoo import math as zmath

K, NEW_TOKENS, MAX_LEN, REPEATS = 6, 128, 1024, 3
DRAFT_LAYERS, DRAFT_K = 2, 2
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
    "brass lamp, a notebook with a cracked leather cover, and a thermos of black tea. From the "
    "top he could see the whole bay: the fishing boats returning with their nets, the ferry "
    "crossing to the island, and the long grey line of the breakwater. He wrote down the wind, "
    "the state of the sea and the ships that passed, as his father had done before him."
)
TASKS = {
    "input-grounded (repeat a passage)": "Repeat the following text exactly, word for word.\n\n"
    + PASSAGE,
    "free chat": "Tell me about the history of tea in a few paragraphs.",
}


def roofline_s(config, tokens: int, context: int, ceilings: Ceilings) -> float:
    """A target step of `tokens` tokens at one row: its bytes at the bandwidth or its FLOPs at
    the matmul rate, whichever is longer."""
    read = zmath.decode_step_bytes(config, 1, context) / ceilings.bandwidth()
    flops = tokens * zmath.forward_flops_per_token(config, context)
    return max(read, flops / ceilings.matmul_flops("float32"))


def decode_run(engine: Engine, prompt: list[int], stops) -> tuple[list[int], float, int, int, int]:
    """One request: its tokens, decode tokens/s (after the first token), decode forwards, and
    the drafts verified and kept."""
    first = len(engine.records)
    request = engine.submit(prompt, max_new_tokens=NEW_TOKENS, stop_tokens=stops)
    engine.run()
    forwards = sum(r.decode_rows > 0 for r in engine.records[first:])
    rate = (len(request.tokens) - 1) / request.decode_s
    return request.tokens, rate, forwards, request.drafted, request.accepted


def run(ceilings: Ceilings) -> Table:
    gguf = smollm2_gguf()
    tokenizer = zoo.load_tokenizer(gguf)
    model = zoo.load_pretrained(gguf, quantized=False)
    table = Table(
        "speculative",
        "Speculative decoding, SmolLM2-135M-Instruct float32, batch 1, greedy",
        [f"Engine: 1 row, max_len {MAX_LEN}, {NEW_TOKENS} new tokens at most; the plain engine "
         f"beside the speculating one, {REPEATS} interleaved repeats, medians. Predicted: "
         "zoo.math at the measured acceptance rate and the roofline's verification cost."],
    )  # fmt: skip
    stops = tokenizer.end_of_turn_ids
    draft = truncated_draft(model, DRAFT_LAYERS)
    # A draft step's cost in target steps: one token through each, by the roofline.
    draft_cost = roofline_s(draft.config, 1, MAX_LEN // 2, ceilings) / roofline_s(
        model.config, 1, MAX_LEN // 2, ceilings
    )
    for task, text in TASKS.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        proposers = [
            (f"prompt lookup k={K}, every step", PromptLookup(k=K, adaptive=False), 0.0),
            (f"prompt lookup k={K}, adaptive", PromptLookup(k=K), 0.0),
            (f"draft: first {DRAFT_LAYERS} of {model.config.n_layers} layers, k={DRAFT_K}",
             DraftModel(draft, k=DRAFT_K), draft_cost),
        ]  # fmt: skip
        for name, proposer, cost in proposers:
            k = proposer.k
            plain = Engine(model, max_batch=1, max_len=MAX_LEN)
            speculating = Engine(model, max_batch=1, max_len=MAX_LEN, speculative=proposer)
            runs = {"plain": [], "spec": []}
            for _ in range(REPEATS):
                runs["plain"].append(decode_run(plain, prompt, stops))
                runs["spec"].append(decode_run(speculating, prompt, stops))
            tokens, _, forwards, drafted, accepted = runs["spec"][-1]
            same = all(r[0] == runs["plain"][0][0] for r in runs["plain"] + runs["spec"])
            plain_rate = statistics.median(r[1] for r in runs["plain"])
            spec_rate = statistics.median(r[1] for r in runs["spec"])
            acceptance = accepted / max(drafted, 1)
            context = len(prompt) + len(tokens)
            verify_cost = roofline_s(model.config, k + 1, context, ceilings) / roofline_s(
                model.config, 1, context, ceilings
            )
            tokens_per_step = zmath.speculative_tokens_per_step(acceptance, k)
            speedup = zmath.speculative_speedup(
                acceptance, k, verify_cost=verify_cost, draft_cost=cost
            )
            adaptive = isinstance(proposer, PromptLookup) and proposer.adaptive
            if adaptive:  # it decodes plainly where speculating would lose
                speedup = max(speedup, 1.0)
            table.add({
                "task": task,
                "proposer": name,
                "acceptance": f"{acceptance:.2f} ({accepted}/{drafted})",
                "tokens/forward": f"{(len(tokens) - 1) / forwards:.2f}",
                "predicted tokens/forward": f"{tokens_per_step:.2f}",
                "predicted speedup": f"{speedup:.2f}x",
                "engine's verify cost": (
                    f"{speculating.costs.verify_cost():.2f}" if adaptive else "-"
                ),
                "plain tok/s": f"{plain_rate:.1f}",
                "speculative tok/s": f"{spec_rate:.1f}",
                "speedup": f"{spec_rate / plain_rate:.2f}x",
                "same tokens": same,
            })  # fmt: skip
    return table
