"""EleutherAI's lm-evaluation-harness on a zoo model: `ZooLM` implements its `LM` interface
(`loglikelihood`, `loglikelihood_rolling`, `generate_until`) with training/scoring.py's batched
log-likelihoods and the serving engine; `run_lm_eval` runs harness tasks (its own or a local
directory of task YAML files) and returns their metrics. Needs the `eval` extra (`lm-eval`).

Token conventions follow the harness's HF model: a context's trailing whitespace moves to the
continuation, the continuation's tokens are those of context + continuation after the context's
(so a merge across the boundary is scored with the continuation), and every sequence starts with
`<|endoftext|>` (the prefix token of `loglikelihood_rolling`).
"""

from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from training.evaluate import completion_text, generate_batched
from training.scoring import score
from zoo import Transformer


class ZooLM(LM):
    """`ZooLM(model, tokenizer)`: a zoo Transformer and its tokenizer (a `zoo.Tokenizer` or a
    tiktoken encoding) as an lm-eval `LM`. `batch_size` rows per scoring batch and engine batch;
    `max_new_tokens` when a request does not say (`max_gen_toks`); `window` tokens scored at
    once (default the model's max_seq_len)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        *,
        batch_size: int = 8,
        max_new_tokens: int = 256,
        window: int | None = None,
    ):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.encoding = getattr(tokenizer, "encoding", tokenizer)
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.window = window or model.config.max_seq_len

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self._encode(context + continuation), self._encode(context)
        return [self.encoding.eot_token, *whole[: len(head)]], whole[len(head) :]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._pair(*request.args) for request in requests]
        scored = score(self.model, pairs, batch_size=self.batch_size, window=self.window)
        return [(s.logprob, s.greedy) for s in scored]

    def loglikelihood_rolling(self, requests) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            ids = self._encode(request.args[0])
            for window in get_rolling_token_windows(
                ids, prefix_token=self.encoding.eot_token, max_seq_len=self.window, context_len=1
            ):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        scored = score(self.model, windows, batch_size=self.batch_size, window=self.window)
        for owner, s in zip(owners, scored, strict=True):
            totals[owner] += s.logprob
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy completions, cut at the first of each request's `until` strings."""
        settings = [dict(request.args[1]) for request in requests]
        budgets = [int(s.get("max_gen_toks", self.max_new_tokens)) for s in settings]
        prompts = [[self.encoding.eot_token, *self._encode(r.args[0])] for r in requests]
        out: list[str] = [""] * len(requests)
        for budget in sorted(set(budgets)):
            indices = [i for i, b in enumerate(budgets) if b == budget]
            completions = generate_batched(
                self.model, [prompts[i] for i in indices], max_new_tokens=budget,
                stop_tokens=(self.encoding.eot_token,), batch_size=self.batch_size,
            )  # fmt: skip
            for i, ids in zip(indices, completions, strict=True):
                text = completion_text(self.tokenizer, ids, (self.encoding.eot_token,))
                out[i] = _cut(text, settings[i].get("until") or ())
        return out


def _cut(text: str, until: str | Sequence[str]) -> str:
    for stop in [until] if isinstance(until, str) else until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


def run_lm_eval(
    model: Transformer,
    tokenizer,
    tasks: Sequence[str],
    *,
    include: str | None = None,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, dict[str, Any]]:
    """{"lm-eval:TASK": {metric: value}} of the harness's `simple_evaluate` on `tasks`, with the
    task YAML files of `include` (a directory) beside the harness's own."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include) if include else TaskManager()
    out = simple_evaluate(
        model=ZooLM(model, tokenizer, batch_size=batch_size),
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        bootstrap_iters=0,
        log_samples=False,
    )
    return {
        f"lm-eval:{name}": {
            key.replace(",none", ""): value
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        for name, metrics in out["results"].items()
    }
