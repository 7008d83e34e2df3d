"""The `openai` backend: any OpenAI-compatible server (`vllm serve`, `transformers serve`, SGLang, ...)
through the `openai` Python client (v1+ API, async).

- At most `max_in_flight` requests are in flight, spread round-robin over the servers' base URLs
  (data-parallel servers of one model); a retry goes to the next server.
- Connection errors, timeouts, HTTP 408, 429 and 5xx, and a 200 whose body is not a usable answer (not
  JSON, truncated, no choices, a choice without its text) are retried with exponential backoff and
  jitter, or after the server's Retry-After when that is longer (capped by `max_backoff`); other errors
  (400, 401, 404, 422, an answer without the token ids the recipe asks for) fail at once.
- All pending samples of a prompt go as one request with `n`; a server that answers fewer choices
  (transformers serve ignores `n`) gets the missing samples, and from then on every sample, as separate
  requests, each with its own seed.
- After `give_up_after` requests in a row failed for good, nothing more is sent: a dead or
  misconfigured server ends the run quickly, and every unsent sample is reported as failed.
- `completions` sends the prompt as the token ids polydraft tokenized (when it loaded the target's
  tokenizer, as it does for chat templates), so that the server generates from exactly those ids: a
  text prompt that starts with the template's BOS would get a second one from the server. `chat` sends
  the messages and the server renders its template (vLLM adds no special tokens to a chat prompt).
The API key is read from the environment by the caller and only handed to the client.

Requests go through the client's generic `post` (its README's way to reach any endpoint) with the body
built here, and the answer is parsed from the raw bytes; the client's HTTP transport is aiohttp
(`openai.DefaultAioHttpClient`). Against `client.completions.create` with httpx this halves the client's
CPU time per request (bench/results/distill_openai.md): `create` validates and transforms every argument
and builds a pydantic model of every answer, work that the plain dicts here do not need.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

from polydraft.distill.requests import Emit, Fail, Generation, Request, request_seed

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429}
PATHS = {"completions": "/completions", "chat": "/chat/completions"}
# the API key as a bearer token, and no other credential the client may know of (as `create` sends)
REQUEST_OPTIONS: dict[str, Any] = {"security": {"bearer_auth": True}}


class MalformedAnswer(ValueError):
    """A 200 whose body is no usable answer: a server fault, worth retrying."""


@dataclass(frozen=True)
class ServerSettings:
    base_urls: list[str]
    model: str
    endpoint: str
    """`completions` or `chat`."""
    api_key: str
    max_in_flight: int
    request_timeout: float
    max_retries: int
    backoff: float
    max_backoff: float
    give_up_after: int
    return_token_ids: bool

    def __repr__(self) -> str:  # never show the key, whatever logs or tracebacks print
        return f"ServerSettings(base_urls={self.base_urls}, model={self.model!r}, endpoint={self.endpoint!r})"


def request_body(
    request: Request,
    sample_indices: list[int],
    settings: ServerSettings,
    top_p: float,
    max_new_tokens: int,
    stop: list[str],
    seed: int,
    stop_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The JSON body of a completions / chat completions request for some samples."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": max_new_tokens,
        "temperature": request.temperature,
        "top_p": top_p,
        "n": len(sample_indices),
        "seed": request_seed(seed, request.key(sample_indices[0])),
    }
    if settings.endpoint == "completions":
        # the token ids themselves where the prompt was tokenized here: the server then generates from
        # exactly what the other backends feed (a text prompt gets the server's BOS in front of the one
        # a chat template already writes)
        ids = request.item.prompt_ids
        body["prompt"] = list(ids) if ids is not None else request.item.prompt
    else:
        body["messages"] = request.item.messages
    if stop:
        body["stop"] = list(stop)
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)  # a vLLM extension of the API
    if settings.return_token_ids:
        body["return_token_ids"] = True  # a vLLM extension of the API
    return body


def parse_body(content: bytes, endpoint: str, return_token_ids: bool) -> list[Generation]:
    """The raw body of a 200 -> one Generation per choice; a body that is not JSON or not an object is a
    server fault (json.JSONDecodeError / MalformedAnswer, both retried)."""
    payload = json.loads(content)
    if not isinstance(payload, dict):
        raise MalformedAnswer(f"the server answered {content[:200]!r}")
    return parse_response(payload, endpoint, return_token_ids)


def parse_response(payload: dict[str, Any], endpoint: str, return_token_ids: bool) -> list[Generation]:
    """A completions / chat completions answer (as a dict) -> one Generation per choice, in index order."""
    usage = payload.get("usage") or {}
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise MalformedAnswer(f"the server answered without choices: {str(payload)[:200]}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    generations = []
    for choice in choices:
        if endpoint == "completions":
            text = choice.get("text")
        else:
            text = (choice.get("message") or {}).get("content")
        if not isinstance(text, str):
            raise MalformedAnswer(f"the server answered a choice without its text: {str(choice)[:200]}")
        ids = choice.get("token_ids")
        if return_token_ids and ids is None:
            raise ValueError(
                "the server returned no token_ids although distill.openai.return_token_ids is set "
                "(only vLLM servers know that field)"
            )
        if ids is not None:
            response_tokens = len(ids)
        elif len(choices) == 1:
            response_tokens = int(usage.get("completion_tokens", -1))
        else:
            response_tokens = -1  # usage counts all choices together
        generations.append(
            Generation(
                text=text,
                finish_reason=str(choice.get("finish_reason") or "unknown"),
                token_ids=[int(t) for t in ids] if ids is not None else None,
                prompt_tokens=int(usage.get("prompt_tokens", -1)),
                response_tokens=response_tokens,
            )
        )
    return generations


def retryable(err: BaseException) -> bool:
    """Connection errors, timeouts, 408, 429, 5xx and a 200 with an unusable body (not JSON, not an
    object, no choices) are worth retrying; other answers are not."""
    import openai

    if isinstance(err, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(err, openai.APIStatusError):
        return err.status_code in RETRY_STATUS or err.status_code >= 500
    return isinstance(
        err, asyncio.TimeoutError | json.JSONDecodeError | MalformedAnswer | openai.APIResponseValidationError
    )


def retry_after(err: BaseException) -> float:
    """The wait in seconds a 429 / 503 asks for (`retry-after-ms` or `Retry-After` in seconds), else 0."""
    import openai

    if not isinstance(err, openai.APIStatusError):
        return 0.0
    headers = err.response.headers
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return max(0.0, float(headers.get(name, "")) * scale)
        except ValueError:
            continue  # absent, or an HTTP date: fall back to the backoff
    return 0.0


def describe(err: BaseException) -> str:
    """`Type: message` of an error, and of its root cause: the aiohttp transport reports a refused or
    dropped connection as `APITimeoutError: Request timed out.`, and only the cause tells what happened."""
    text = f"{type(err).__name__}: {err}"
    cause = err.__cause__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    return text if cause is None else f"{text} (cause: {type(cause).__name__}: {cause})"


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: half of min(cap, base * 2^attempt) plus up to as much again at
    random, so that many clients retrying together spread out."""
    ceiling = min(cap, base * 2**attempt)
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


class _Run:
    """State of one generate_openai call: clients, counters, the give-up switch."""

    def __init__(self, settings: ServerSettings, sampling: dict[str, Any], emit: Emit, fail: Fail):
        import openai

        self.settings = settings
        self.sampling = sampling
        self.emit = emit
        self.fail = fail
        self.clients = [
            openai.AsyncOpenAI(
                base_url=url,
                api_key=settings.api_key,
                timeout=settings.request_timeout,
                max_retries=0,
                http_client=openai.DefaultAioHttpClient(),
            )
            for url in settings.base_urls
        ]
        self.ignores_n = [False] * len(self.clients)
        self.rng = random.Random(sampling["seed"])
        self.failed_in_a_row = 0
        self.last_error = ""
        self.stopped = False
        self.stats = {"requests": 0, "retries": 0, "failed_requests": 0, "n_fallbacks": 0}

    async def send(self, request: Request, indices: list[int], server: int) -> int | None:
        """One request (with retries) for `indices`; returns how many samples it answered, None on failure."""
        settings = self.settings
        body = request_body(request, indices, settings, **self.sampling)
        for attempt in range(settings.max_retries + 1):
            index = (server + attempt) % len(self.clients)
            client = self.clients[index]
            self.stats["requests"] += 1
            try:
                content = await client.post(
                    PATHS[settings.endpoint], cast_to=bytes, body=body, options=REQUEST_OPTIONS
                )
                generations = parse_body(content, settings.endpoint, settings.return_token_ids)
            except Exception as err:  # noqa: BLE001 - every failure is classified and reported
                if retryable(err) and attempt < settings.max_retries:
                    self.stats["retries"] += 1
                    delay = backoff_delay(attempt, settings.backoff, settings.max_backoff, self.rng)
                    await asyncio.sleep(min(settings.max_backoff, max(delay, retry_after(err))))
                    continue
                reason = f"{describe(err)} (server {settings.base_urls[index]}, {attempt + 1} attempt(s))"
                self.record_failure(request, indices, reason)
                return None
            self.failed_in_a_row = 0
            for sample_index, generation in zip(indices, generations, strict=False):
                self.emit(request, sample_index, generation)
            return min(len(indices), len(generations))
        return None  # unreachable: the last attempt either returns or records the failure

    def record_failure(self, request: Request, indices: list[int], reason: str) -> None:
        self.stats["failed_requests"] += 1
        self.failed_in_a_row += 1
        self.last_error = reason
        for sample_index in indices:
            self.fail(request, sample_index, reason)
        if self.failed_in_a_row >= self.settings.give_up_after and not self.stopped:
            self.stopped = True
            log.error(
                "openai: %d requests in a row failed; sending no more (last: %s)",
                self.failed_in_a_row,
                reason,
            )

    async def handle(self, request: Request, server: int) -> None:
        indices = list(request.sample_indices)
        if len(indices) > 1 and not self.ignores_n[server]:
            answered = await self.send(request, indices, server)
            if answered is None or answered == len(indices):
                return
            if not self.ignores_n[server]:
                self.ignores_n[server] = True
                log.info(
                    "openai: %s ignores `n`; sending one request per sample", self.settings.base_urls[server]
                )
            self.stats["n_fallbacks"] += 1
            indices = indices[answered:]
        for sample_index in indices:
            if self.stopped:
                return
            await self.send(request, [sample_index], server)

    async def worker(self, queue: asyncio.Queue, server: int) -> None:
        while not self.stopped:
            try:
                request = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await self.handle(request, server)

    async def run(self, requests: list[Request]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for request in requests:
            queue.put_nowait(request)
        workers = min(self.settings.max_in_flight, len(requests))
        try:
            await asyncio.gather(*(self.worker(queue, i % len(self.clients)) for i in range(workers)))
        finally:
            for client in self.clients:
                await client.close()
        while not queue.empty():  # left unsent after giving up: reported, never a silent gap
            request = queue.get_nowait()
            for sample_index in request.sample_indices:
                self.fail(
                    request,
                    sample_index,
                    f"not sent: the run stopped after {self.failed_in_a_row} requests in a row failed (last: {self.last_error})",
                )


def generate_openai(
    requests: list[Request],
    settings: ServerSettings,
    *,
    top_p: float,
    max_new_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    seed: int,
    emit: Emit,
    fail: Fail,
) -> dict[str, int]:
    """Answer every pending sample through the servers; returns request counters."""
    sampling = {
        "top_p": top_p, "max_new_tokens": max_new_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
        "seed": seed,
    }  # fmt: skip
    run = _Run(settings, sampling, emit, fail)
    asyncio.run(run.run(requests))
    return run.stats
