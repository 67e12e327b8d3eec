"""The OpenAI-compatible HTTP API on FastAPI: `POST /v1/chat/completions`, `POST
/v1/completions`, `GET /v1/models`, `GET /health`; `stream: true` as server-sent events
(sse-starlette) in OpenAI's chunk format, ending with `data: [DONE]`.

Every HTTP request becomes engine requests (one per choice, `n`); the engine runs on its own
thread (`EngineThread`, started and stopped with the app's lifespan). Errors are OpenAI's JSON:
a malformed body or a refused setting 400, an unknown model 404, a body over the size limit
413, a full queue 429 with Retry-After, a failed generation 500, a failed engine 503. A failure
stays inside its request.
"""

import contextlib
import json
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.exceptions import HTTPException

from infer.engine import Engine
from infer.serve import protocol
from infer.serve.generation import BadRequest, Disconnected, GenerationFailed, Generations, Piece
from infer.serve.logprobs import LogprobFormat
from infer.serve.protocol import ChatRequest, CompletionRequest, Sampling, error_body
from infer.serve.worker import EngineFailed, EngineThread, QueueFull
from layers.lora_bank import adapters_in
from zoo.tokenizer import Tokenizer

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


class BodyLimit:
    """Refuses (413) a request body over `max_bytes` before the app reads it whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            body = json.dumps(
                error_body(
                    f"the request body ({int(length)} bytes) exceeds the server's limit of "
                    f"{self.max_bytes} bytes"
                )
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return None
        return await self.app(scope, receive, send)


def make_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    name: str,
    adapters: Sequence[str] = (),
    max_waiting: int = 64,
    max_n: int | None = None,
    max_body_bytes: int = 4 << 20,
) -> FastAPI:
    """The server's app over `engine` (which it starts on its own thread for the app's
    lifespan) and the checkpoint's `tokenizer`; the model is served as `name` (and as "base"),
    and its banked LoRA adapters (`zoo.bank_adapters`), in order, as `adapters`. At most
    `max_waiting` engine requests wait beyond the engine's rows; `n` up to `max_n` (default:
    the engine's rows)."""
    # On SIGTERM uvicorn stops taking connections and waits for those in flight; sse-starlette
    # would cut open streams at once: let them finish instead (the drain).
    AppStatus.disable_automatic_graceful_drain()
    if len(adapters) != adapters_in(engine.model):
        raise ValueError(
            f"{len(adapters)} adapter name(s) for a model with {adapters_in(engine.model)} "
            "banked adapter(s)"
        )
    # Each served name -> the engine's adapter index (-1: the base model).
    served = {name: -1, "base": -1, **{a: i for i, a in enumerate(adapters)}}
    if len(served) != len(adapters) + 2:
        raise ValueError(f"served names must differ: {name}, base, {', '.join(adapters)}")
    worker = EngineThread(engine, max_waiting=max_waiting)
    generations = Generations(worker, tokenizer, max_n=max_n or engine.max_batch)
    formatter = LogprobFormat(tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # every request in flight was answered (uvicorn drained them first)

    app = FastAPI(title="eqx-zoo", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.worker, app.state.generations = worker, generations

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(
            error_body(error.message, error.kind, error.param),
            status_code=error.status,
            headers=error.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, error: RequestValidationError):
        return _invalid(error.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail)), error.status_code, error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return JSONResponse(error_body(f"internal error: {error!r}", "server_error"), 500)

    def adapter_of(model: str) -> int:
        if model not in served:
            raise APIError(
                404,
                f"model {model!r} is not served here; the served models are: "
                f"{', '.join([f'{name} (also called base)', *adapters])}",
                param="model",
                kind="not_found_error",
            )
        return served[model]

    def submit_errors(error: Exception) -> APIError:
        if isinstance(error, QueueFull):
            return APIError(
                429,
                f"the server is busy ({error}); retry later",
                kind="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if isinstance(error, EngineFailed):
            return APIError(503, str(error), kind="server_error")
        return APIError(400, str(error))

    async def respond(http: Request, body: Sampling, prompt: list[int], max_tokens, *, chat: bool):
        try:
            choices = generations.choices(prompt, body, max_tokens, adapter_of(body.model))
        except BadRequest as error:
            raise APIError(400, str(error)) from None
        kind = "chat.completion" if chat else "text_completion"
        meta = {
            "id": protocol.new_id("chatcmpl" if chat else "cmpl"),
            "created": protocol.now(),
            "model": body.model,
        }
        counts = [0] * len(choices)
        logprobs = formatter if choices[0].logprobs is not None else None
        pieces = generations.pieces(choices, body.stops(), http.is_disconnected, counts)
        try:  # the first piece: submission errors become HTTP errors before anything is sent
            first = await anext(pieces, None)
        except (QueueFull, EngineFailed, ValueError) as error:
            raise submit_errors(error) from None
        except GenerationFailed as error:
            raise APIError(500, str(error), kind="server_error") from None
        except Disconnected:
            return JSONResponse(error_body("client disconnected"), 499)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(
                first,
                pieces,
                meta,
                kind,
                chat,
                len(choices),
                counts,
                len(prompt) if include_usage else None,
                logprobs,
            )
            return EventSourceResponse(events, ping=15)
        texts, reasons = [""] * len(choices), [None] * len(choices)
        entries = [[] for _ in choices]
        try:
            async for piece in _chain(first, pieces):
                texts[piece.index] += piece.text
                reasons[piece.index] = piece.finish_reason or reasons[piece.index]
                entries[piece.index].extend(piece.logprobs)
        except GenerationFailed as error:
            raise APIError(500, str(error), kind="server_error") from None
        except Disconnected:
            return JSONResponse(error_body("client disconnected"), 499)
        finally:
            await pieces.aclose()
        out = [
            _choice(i, text, reason, chat, _logprobs(logprobs, entries[i], chat))
            for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
        ]
        return {
            **meta,
            "object": kind,
            "choices": out,
            "usage": protocol.usage(len(prompt), sum(counts)),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        body = await _parse(http, ChatRequest)
        adapter_of(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as error:  # no template, or one that refuses these messages
            raise APIError(400, f"cannot render the chat: {error}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(http, body, prompt, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await _parse(http, CompletionRequest)
        adapter_of(body.model)
        if isinstance(body.prompt, str):
            prompt = tokenizer.encode(body.prompt)
        else:
            prompt = list(body.prompt)
            vocab = engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not prompt:
            raise APIError(400, "the prompt is empty; give at least one token", param="prompt")
        return await respond(http, body, prompt, body.max_tokens, chat=False)

    @app.get("/v1/models")
    async def models():
        cards = [
            {"id": model, "object": "model", "created": 0, "owned_by": "eqx-zoo",
             "max_model_len": engine.max_len, **({"parent": name} if model != name else {})}
            for model in (name, *adapters)
        ]  # fmt: skip
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        if worker.failed is not None:
            return JSONResponse(
                error_body(f"the engine failed: {worker.failed!r}", "server_error"), 503
            )
        return {"status": "ok", "requests": worker.load}

    return app


def _invalid(errors) -> JSONResponse:
    """A pydantic validation failure as OpenAI's 400, naming each field and what was wrong."""
    where = lambda e: ".".join(str(p) for p in e["loc"] if p != "body") or "body"  # noqa: E731
    problems = "; ".join(f"{where(e)}: {e['msg']}" for e in errors)
    param = where(errors[0]) if errors else None
    return JSONResponse(error_body(f"invalid request: {problems}", param=param), 400)


async def _parse(http: Request, model: type[BaseModel]):
    """The body as `model`: UTF-8 JSON (RFC 8259) holding an object of its fields."""
    raw = await http.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not UTF-8 ({error}); send UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


async def _chain(first: Piece | None, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    if first is not None:
        yield first
    async for piece in rest:
        yield piece


def _logprobs(formatter: LogprobFormat | None, entries, chat: bool, offset: int = 0) -> dict | None:
    """A choice's (or chunk's) `logprobs` field: null unless they were asked for."""
    if formatter is None:
        return None
    return formatter.chat(entries) if chat else formatter.completion(entries, offset)


def _choice(index: int, text: str, reason: str | None, chat: bool, logprobs: dict | None) -> dict:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": logprobs,
        }
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def _delta(
    index: int, text: str | None, reason: str | None, chat: bool, role: bool, logprobs=None
) -> dict:
    if not chat:
        return {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
    delta = {"role": "assistant", "content": ""} if role else {}
    if text:
        delta["content"] = text
    return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}


async def _stream(first, pieces, meta, kind, chat, n, counts, prompt_tokens, logprobs=None):
    """OpenAI's chunks: (chat) a role chunk per choice, a chunk per piece (with its tokens'
    log-probabilities when `logprobs` formats them), the finish reason on the last; with
    include_usage a last chunk of usage; then [DONE]. An error mid-stream is an error event
    (the status line was sent already)."""
    chunk = {**meta, "object": f"{kind}.chunk" if chat else kind}
    extra = {"usage": None} if prompt_tokens is not None else {}
    offsets = [0] * n  # each choice's characters of token texts so far (text_offset)

    def data(choices) -> str:
        return json.dumps({**chunk, "choices": choices, **extra})

    try:
        if chat:
            for i in range(n):
                yield data([_delta(i, None, None, chat, role=True)])
        async for piece in _chain(first, pieces):
            if piece.text or piece.finish_reason or piece.logprobs:
                i, scores = piece.index, None
                if piece.logprobs:
                    scores = _logprobs(logprobs, piece.logprobs, chat, offsets[i])
                    offsets[i] += logprobs.length(piece.logprobs)
                yield data([_delta(i, piece.text, piece.finish_reason, chat, False, scores)])
    except GenerationFailed as error:
        yield json.dumps(error_body(str(error), "server_error"))
        yield "[DONE]"
        return
    except Disconnected:
        return
    finally:  # a client gone mid-stream: its engine requests end now, not when collected
        await pieces.aclose()
    if prompt_tokens is not None:
        yield json.dumps(
            {**chunk, "choices": [], "usage": protocol.usage(prompt_tokens, sum(counts))}
        )
    yield "[DONE]"
