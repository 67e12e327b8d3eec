"""Speculative decoding in the serving engine (infer/speculative/), SmolLM2-135M-Instruct in
float32 (the GGUF dequantized), batch 1, greedy, side by side in one run with the same engine
without speculation:

- prompt lookup (`PromptLookup(k=6)`) on an input-grounded task (repeat a passage word for word)
  and on free chat (where nothing recurs: it should cost little and win nothing), verifying
  every step that has a draft (`adaptive=False`) and adaptive (the engine verifies only in steps
  where the rows' running acceptance and the measured step costs make it pay,
  infer/speculative/adaptive.py);
- draft models, adaptive: the target's first 2 layers untrained (`truncated_draft`: its drafts
  are rarely kept, so the engine should decode plainly), and the draft distilled by
  `python -m examples.train_draft` (read from `EQX_ZOO_DRAFT`, default runs/draft/model; its
  rows are left out, with a note, when it is not there), in int8 (`zoo.quantize`: a draft's
  weights are read once per draft, so it reads a quarter of the bytes; q stays a distribution
  over the whole vocabulary), on both tasks, and on free chat verifying every step; then on free
  chat with its head cut to the draft vocabulary the example wrote beside it (`draft_vocab`:
  the head is most of a 4-layer draft's bytes);
- the target's own multi-token-prediction module trained by `python -m examples.train_draft
  --mtp` (read from `EQX_ZOO_MTP`, default runs/draft/mtp; left out, with a note, when it is not
  there), one layer that reads the target's hidden state (EAGLE's recipe), its head cut to the
  draft vocabulary beside it, verifying every step (`MTPDraft` is not adaptive), on free chat at
  a few k.

Each row prints the drafts kept of those verified, the acceptance rate (kept over judged: the
drafts after a rejection are never judged, so a verification of k drafts that keeps a of them
is a trials and, when a < k, one rejection: Leviathan et al.'s rate, which zoo.math takes), the
tokens one target forward emitted (decode steps only), the decode speed of both engines
(median of interleaved repeats) and their CPU-seconds per token (the process's, both cores;
steadier than wall time on a shared machine), beside the prediction of zoo.math: the expected
tokens per step at the measured acceptance rate (`speculative_tokens_per_step`) and the speedup
once the costs are counted (`speculative_speedup`), with the costs on paper and measured here:
- a draft's cost in one-token target steps: on paper the bytes of its weights over the
  target's (decode reads every weight once per token); measured, what the drafts add to a
  verifying step, per draft, as the engine times its own programs (`Engine.time_steps`);
- the verification's cost (a `k + 1`-token target step over a one-token one): on paper by the
  roofline of the ceilings measured in this run; measured likewise, for every k up to K;
and the acceptance rate a draft needs for the issue's 1.3x at those measured costs
(`speculative_acceptance_needed`). An adaptive draft model's engine chooses each step's drafts
per row (infer/speculative/adaptive.py), so its row is predicted at the best k for the measured
costs and needs the lowest acceptance over k; its predicted speedup is at least that of plain
decoding with the draft's one forward beside each step (its observation). Every speculative
run's tokens are checked against the plain engine's.

    python -m bench speculative
"""

import functools
import os
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import zoo
from bench.harness import Ceilings, Table
from cli.flags import default_chat_model as smollm2_gguf
from infer.engine import Engine
from infer.speculative import DraftModel, MTPDraft, PromptLookup, draft_vocab, truncated_draft
from infer.speculative.draft import head_rows
from infer.speculative.mtp import MTP_FILE
from zoo import math as zmath

K, NEW_TOKENS, MAX_LEN, REPEATS = 6, 128, 1024, 3
DRAFT_K, TIMINGS, SPEEDUP_GOAL = 4, 7, 1.3
DRAFT = Path(os.environ.get("EQX_ZOO_DRAFT", "runs/draft/model"))
MTP = Path(os.environ.get("EQX_ZOO_MTP", "runs/draft/mtp"))
MTP_KS, MTP_INT8_K = (2, 3, 4), 3
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


def verify_on_paper(config, context: int, ceilings: Ceilings, k: int) -> float:
    """A verification of `k` drafts in one-token target steps, by the roofline."""
    return roofline_s(config, k + 1, context, ceilings) / roofline_s(config, 1, context, ceilings)


def weight_bytes(model) -> int:
    """The bytes of a model's arrays (packed weights as packed): what one decode forward reads."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model) if isinstance(leaf, jax.Array))


def verify_costs(model) -> dict[int, float]:
    """A verification of k drafts (k = 1..K) in one-token target steps, as the engine times its
    own programs (`Engine.time_steps`: the plain and the verifying step of an adaptive
    `PromptLookup(k)` engine on idle rows), the engines timed in turn, medians."""
    engines = {
        k: Engine(model, max_batch=1, max_len=MAX_LEN, speculative=PromptLookup(k=k))
        for k in range(1, K + 1)
    }
    for _ in range(TIMINGS):
        for engine in engines.values():
            engine.time_steps(1)
    costs = {k: engine.costs.verify_cost() for k, engine in engines.items()}
    release_programs()
    return costs


def release_programs() -> None:
    """Drop the compiled programs of the engines measured so far: each holds ~400 memory
    mappings of its code, and the bench's dozens of engines (a program set per draft, module and
    k) passed Linux's vm.max_map_count (LLVM then fails to allocate)."""
    jax.clear_caches()


def drafting_costs(model, proposer: DraftModel | MTPDraft) -> tuple[float, float]:
    """What drafting adds, in one-token target steps: to a plain step (a draft model's one
    forward beside it in an adaptive engine) and per draft to a verifying step of `k`: the
    proposer's engine's step times against the same target programs without drafting (a
    `PromptLookup(k)` engine), timed in turn, medians."""
    k = proposer.k
    drafting = Engine(model, max_batch=1, max_len=MAX_LEN, speculative=proposer)
    plain = Engine(model, max_batch=1, max_len=MAX_LEN, speculative=PromptLookup(k=k))
    for _ in range(TIMINGS):
        drafting.time_steps(1)
        plain.time_steps(1)
    step = plain.costs.median("plain")
    release_programs()
    beside = drafting.costs.median("plain") / step - 1 if drafting.adaptive else 0.0
    per_draft = (drafting.costs.median(k) - plain.costs.median(k)) / step / k
    return max(beside, 0.0), max(per_draft, 0.0)


def mtp_bytes(model, head) -> int:
    """What one forward of the model's module reads: its weights but the token table (rows
    are gathered, the table is not read) and the head, and the cut head's rows."""
    body = model.mtp.body
    head_bytes = 0 if body.lm_head is None else weight_bytes(body.lm_head)  # tied: the table
    tables = weight_bytes(body.embed) + head_bytes
    return weight_bytes(model.mtp) - tables + weight_bytes(head)


def mtp_rows(model, notes: list[str]) -> list[tuple]:
    """A row per k of the target with its trained module attached (float32, and int8 at
    `MTP_INT8_K`: the module's weights are read once per draft), with the target it runs on;
    none when there is no module."""
    file = MTP / MTP_FILE
    if not file.exists():
        notes.append(f"No trained MTP module at {file} (EQX_ZOO_MTP): its rows are left out; "
                     "`python -m examples.train_draft --mtp` writes one.")  # fmt: skip
        return []
    vocab = draft_vocab(MTP)
    ids = vocab if vocab is not None else jnp.arange(model.config.vocab_size)
    cut = f", head cut to {len(ids)} tokens" if vocab is not None else ""
    floats = zoo.load_mtp(model, file)
    packed = floats.with_mtp(
        eqx.tree_at(lambda m: m.body, floats.mtp, zoo.quantize(floats.mtp.body, "int8"))
    )
    rows = []
    for k, target, dtype in [
        *((k, floats, "float32") for k in MTP_KS),
        (MTP_INT8_K, packed, "int8"),
    ]:
        proposer = MTPDraft(k=k, vocab=vocab)
        read = mtp_bytes(target, head_rows(target.mtp.body, ids))
        paper = read / weight_bytes(model)
        _, measured = drafting_costs(target, proposer)
        notes.append(f"MTP module {dtype}, k={k}: {read / 1e6:.1f} MB read per forward "
                     f"({paper:.3f} of the target's); measured, a draft of a verifying step "
                     f"{measured:.3f} target steps.")  # fmt: skip
        rows.append((f"MTP module trained, {dtype}{cut}, k={k}, every step", proposer, paper,
                     measured, 0.0, ("free chat",), target))  # fmt: skip
    return rows


def decode_run(engine: Engine, prompt: list[int], stops) -> tuple:
    """One request: its tokens, decode tokens/s (after the first token), CPU-seconds per new
    token (the whole request), decode forwards, the drafts verified and kept, and the
    verifications that rejected one."""
    first = len(engine.records)
    cpu = time.process_time()
    request = engine.submit(prompt, max_new_tokens=NEW_TOKENS, stop_tokens=stops)
    engine.run()
    cpu = (time.process_time() - cpu) / len(request.tokens)
    forwards = sum(r.decode_rows > 0 for r in engine.records[first:])
    rate = (len(request.tokens) - 1) / request.decode_s
    return request.tokens, rate, cpu, forwards, request.drafted, request.accepted, request.rejected


def draft_bytes(proposer: DraftModel) -> int:
    """What one draft forward reads: the model's weights, its head cut to the draft
    vocabulary's rows when it has one (the whole table is then never read)."""
    model = proposer.model
    if proposer.head is None:
        return weight_bytes(model)
    whole = model.embed if model.lm_head is None else model.lm_head
    return weight_bytes(model) - weight_bytes(whole) + weight_bytes(proposer.head)


def draft_rows(model, notes: list[str]) -> list[tuple]:
    """(name, proposer, paper draft cost, measured draft cost, tasks) of each draft model, in
    int8."""
    target_bytes = weight_bytes(model)
    untrained = zoo.quantize(truncated_draft(model, 2), "int8")
    drafts = [("first 2 layers, untrained, int8", untrained, None, (True,), ("free chat",))]
    if DRAFT.exists():
        trained = zoo.quantize(zoo.load_pretrained(DRAFT), "int8")
        name = f"{trained.config.n_layers} layers distilled, int8"
        drafts.append((name, trained, None, (True, False), tuple(TASKS)))
        vocab = draft_vocab(DRAFT)
        if vocab is not None:
            name += f", head cut to {vocab.size} tokens"
            drafts.append((name, trained, vocab, (True, False), ("free chat",)))
    else:
        notes.append(f"No distilled draft at {DRAFT} (EQX_ZOO_DRAFT): its rows are left out; "
                     "`python -m examples.train_draft` writes one.")  # fmt: skip
    rows = []
    for name, draft, vocab, modes, tasks in drafts:
        proposers = [DraftModel(draft, k=DRAFT_K, adaptive=a, vocab=vocab) for a in modes]
        paper = draft_bytes(proposers[0]) / target_bytes
        beside, measured = drafting_costs(model, proposers[0])
        notes.append(f"Draft {name}: {draft_bytes(proposers[0]) / 1e6:.0f} MB read per forward "
                     f"({paper:.3f} of the target's); measured in target steps: a draft of a "
                     f"verifying step's {DRAFT_K} {measured:.3f}, one forward beside a plain "
                     f"step {beside:.3f}.")  # fmt: skip
        for proposer in proposers:
            how = "adaptive" if proposer.adaptive else "every step"
            row = (f"draft: {name}, k={DRAFT_K}, {how}", proposer, paper, measured, beside, tasks)
            rows.append(row)
    return rows


def run(ceilings: Ceilings) -> Table:
    gguf = smollm2_gguf()
    tokenizer = zoo.load_tokenizer(gguf)
    model = zoo.load_pretrained(gguf, quantized=False)
    notes = []
    notes[:0] = [
        f"Engine: 1 row, max_len {MAX_LEN}, {NEW_TOKENS} new tokens at most; the plain engine "
        f"beside the speculating one, {REPEATS} interleaved repeats, medians. Predicted: "
        "zoo.math at the measured acceptance rate, with the costs on paper (draft: weight bytes; "
        "verification: roofline) and measured (the engine timing its own programs).",
        f"Load average at the start: {os.getloadavg()[0]:.1f}.",
    ]
    verify_measured = verify_costs(model)
    notes.append("A verification of k drafts in one-token target steps, measured: "
                 + ", ".join(f"k={k}: {v:.2f}" for k, v in verify_measured.items()))  # fmt: skip
    proposers = [
        (f"prompt lookup k={K}, every step", PromptLookup(k=K, adaptive=False), 0, 0, 0, TASKS),
        (f"prompt lookup k={K}, adaptive", PromptLookup(k=K), 0, 0, 0, TASKS),
        *draft_rows(model, notes),
        *mtp_rows(model, notes),
    ]
    table = Table("speculative", "Speculative decoding, SmolLM2-135M-Instruct float32, batch 1, "
                  "greedy", notes)  # fmt: skip
    stops = tokenizer.end_of_turn_ids
    for task, text in TASKS.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        for name, proposer, paper_draft, measured_draft, beside, tasks, *on in proposers:
            if task not in tasks:
                continue
            k, target = proposer.k, on[0] if on else model  # an MTP row's target has its module
            plain = Engine(target, max_batch=1, max_len=MAX_LEN)
            speculating = Engine(target, max_batch=1, max_len=MAX_LEN, speculative=proposer)
            runs = {"plain": [], "spec": []}
            for _ in range(REPEATS):
                runs["plain"].append(decode_run(plain, prompt, stops))
                runs["spec"].append(decode_run(speculating, prompt, stops))
            tokens, _, _, forwards, drafted, accepted, rejected = runs["spec"][-1]
            same = all(r[0] == runs["plain"][0][0] for r in runs["plain"] + runs["spec"])
            plain_rate, spec_rate, plain_cpu, spec_cpu = (
                statistics.median(r[i] for r in runs[kind])
                for kind, i in (("plain", 1), ("spec", 1), ("plain", 2), ("spec", 2))
            )
            acceptance = accepted / max(accepted + rejected, 1)  # per judged draft
            per_step = zmath.speculative_tokens_per_step(acceptance, k)
            context = len(prompt) + len(tokens)
            verify_paper_of = functools.partial(verify_on_paper, model.config, context, ceilings)
            verify_paper, verify = verify_paper_of(k), verify_measured[k]
            # An adaptive draft model's engine picks the drafts per row each step: its best k.
            choices = range(1, k + 1) if speculating.adaptive and measured_draft else [k]
            needs = [
                zmath.speculative_acceptance_needed(
                    SPEEDUP_GOAL, j, verify_cost=verify_measured[j], draft_cost=measured_draft
                )
                for j in choices
            ]
            needed = min((n for n in needs if n is not None), default=None)
            predicted = {
                how: max(
                    zmath.speculative_speedup(acceptance, j, verify_cost=cost(j), draft_cost=draft)
                    for j in choices
                )
                for how, cost, draft in (
                    ("paper", verify_paper_of, paper_draft),
                    ("measured", verify_measured.get, measured_draft),
                )
            }
            if speculating.adaptive:  # it decodes plainly where speculating would lose
                floor = 1 / (1 + beside)  # a plain step with the draft's observation
                predicted = {how: max(gain, floor) for how, gain in predicted.items()}
            table.add({
                "task": task,
                "proposer": name,
                "kept / drafted": f"{accepted}/{drafted}",
                "acceptance": f"{acceptance:.2f}",
                "tokens/forward": f"{(len(tokens) - 1) / forwards:.2f}",
                "predicted tokens/forward": f"{per_step:.2f}",
                "draft cost paper / measured": f"{paper_draft:.3f} / {measured_draft:.3f}",
                "verify cost paper / measured": f"{verify_paper:.2f} / {verify:.2f}",
                f"acceptance for {SPEEDUP_GOAL}x": "-" if needed is None else f"{needed:.2f}",
                "predicted speedup paper / measured":
                    f"{predicted['paper']:.2f}x / {predicted['measured']:.2f}x",
                "engine's verify cost": (
                    f"{speculating.costs.verify_cost():.2f}" if speculating.adaptive else "-"
                ),
                "plain tok/s": f"{plain_rate:.1f}",
                "speculative tok/s": f"{spec_rate:.1f}",
                "speedup": f"{spec_rate / plain_rate:.2f}x",
                "speedup, CPU-s per token": f"{plain_cpu / spec_cpu:.2f}x",
                "same tokens": same,
            })  # fmt: skip
            release_programs()
    notes.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    return table
