"""An OpenAI-compatible HTTP server on the engine (`python -m infer.serve CHECKPOINT`): chat and
text completions, streamed as server-sent events, stop strings, seeds, `n` choices,
log-probabilities (`logprobs`, `top_logprobs`), structured output (JSON schema, regex, Lark
through llguidance, masked on the device inside the engine's step). Needs the `serve` extra
(FastAPI, uvicorn, sse-starlette, llguidance)."""

from infer.serve.app import make_app

__all__ = ["make_app"]
