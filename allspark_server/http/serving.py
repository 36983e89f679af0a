"""One generation request from validated input to response: tokenize (chat template), admit, start, read the
tokens, detokenize, cut at stop strings, and answer as SSE chunks or one JSON body; release the engine request
whatever happens (finished, stop string, client gone, error) and record its metrics.

Owns the per-request flow only; validation is protocol.py, bodies responses.py, the engine backend.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from allspark_client.client import PoolUnavailable
from allspark_client.types import AsStatus, GenerateRequestStatus, pool_failed
from allspark_server.http.admission import Admission, Overloaded
from allspark_server.http.chat_template import (
    RENDER_TIMEOUT_S,
    TemplateFailed,
    TemplateRenderer,
    continued,
    template_variables,
)
from allspark_server.http.choices import ChoiceGroup, SharedSlot
from allspark_server.http.detokenize import IncrementalDetokenizer, StopMatcher, TokenText
from allspark_server.http.echo import echo_text, echo_tokens
from allspark_server.http.protocol import (
    ApiError,
    ApiRequest,
    bad_request,
    check_prompt_chars,
    error_from_engine,
    generation_config,
    max_new_tokens,
)
from allspark_server.http.responses import SSE_DONE, ResponseBuilder, TokenLogprob, sse
from allspark_server.http.stream import Generation, QueueReader
from allspark_server.http.tools.chat import ChatToolOutput, ServerTools, tools_active

log = logging.getLogger("allspark.http")
DISCONNECT_CHECK_S = 0.5     # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1
MAX_CHARS_PER_TOKEN = 32     # assumed by the prompt check before tokenizing; text averages 3-5 characters a token


def chars_per_token(tokenizer) -> int:
    """The most characters one token stands for, as the prompt check assumes: the vocabulary's longest token (a
    byte-level token's symbols are bytes, each at least one character's worth), at most MAX_CHARS_PER_TOKEN."""
    return max(1, min(MAX_CHARS_PER_TOKEN, max(map(len, tokenizer.get_vocab()), default=MAX_CHARS_PER_TOKEN)))


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends (finished, client gone, cancelled)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class Piece:
    text: str
    tokens: list[TokenLogprob] = field(default_factory=list)


def _chat_template(tokenizer) -> Optional[str]:
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template()        # a dict of named templates: its "default"
    except Exception:                                # no default among named templates
        return None


class Serving:
    def __init__(self, backend, admission: Admission, reader: QueueReader, metrics,
                 chat_template_timeout_s: float = RENDER_TIMEOUT_S, tool_call_parser: Optional[str] = None):
        self.backend, self.admission, self.reader, self.metrics = backend, admission, reader, metrics
        self.token_text = TokenText(backend.tokenizer)
        self.chars_per_token = chars_per_token(backend.tokenizer)
        template = _chat_template(backend.tokenizer)
        self.tools = ServerTools(backend.tokenizer, template, tool_call_parser)    # tools/chat.py
        # rendered in worker processes, within a time budget and at most the characters a prompt can hold
        self.templates = None if template is None else TemplateRenderer(
            template, template_variables(backend.tokenizer), backend.engine_max_length * self.chars_per_token,
            source=getattr(backend, "template_source", "the model's chat template"),
            timeout_s=chat_template_timeout_s)

    def warm(self) -> None:
        if self.templates is not None:
            self.templates.warm()

    def close(self) -> None:
        if self.templates is not None:
            self.templates.close()

    async def _render(self, req: ApiRequest, add_generation_prompt: bool = True) -> str:
        """The chat prompt's text, rendered off the control threads (chat_template.py); 400 naming the template
        when it fails, runs out of time or renders more than a prompt can hold."""
        if self.templates is None:
            raise bad_request("this model has no chat template (its tokenizer_config.json / chat_template.jinja "
                              "defines none): use /v1/completions", param="messages", code="no_chat_template")
        messages = req.messages
        if "developer" not in str(self.backend.tokenizer.chat_template):   # OpenAI's newer name of the system role
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        messages, tools = self.tools.template_input(messages, req.tools, req.tool_choice)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]   # as apply_chat_template
        try:
            if req.continue_final:                   # Anthropic's prefill: the last message goes on
                return continued(await self.templates.render_async(messages, tools, False), messages[-1]["content"])
            return await self.templates.render_async(messages, tools, add_generation_prompt)
        except TemplateFailed as e:
            raise bad_request(str(e), param="messages", code="chat_template_error") from None

    def _prompt_ids(self, req: ApiRequest, text: Optional[str]) -> list[int]:
        tok = self.backend.tokenizer
        if req.kind == "completion":
            return tok(req.prompt)["input_ids"] if isinstance(req.prompt, str) else req.prompt
        if req.images:                         # a vision-language model's (http/chat_images.py)
            text, req.image_inputs = self.backend.images.inputs(text, req.images)
        return tok(text, add_special_tokens=False)["input_ids"]

    async def prompt_ids(self, req: ApiRequest) -> list[int]:
        """The prompt's token ids: a chat rendered by the chat template and tokenized, or the completion's prompt."""
        b = self.backend
        check_prompt_chars(req, b.engine_max_length, self.chars_per_token)
        if req.images and b.images is None:
            raise bad_request(f"model '{req.model}' takes no images: send text parts only", param="messages",
                              code="images_not_supported")
        text = await self._render(req) if req.kind == "chat" else None
        return await asyncio.get_running_loop().run_in_executor(b.executor, self._prompt_ids, req, text)

    async def handle(self, request: Request, req: ApiRequest) -> Response:
        if (req.best_of or req.n) > 1:
            group = ChoiceGroup(await self.start_choices(req, req.best_of or req.n), req)
            if req.stream:
                return SSEResponse(group.sse(), on_close=group.close)
            return await group.respond(request)
        run = await self.start(req)
        if req.stream:
            return SSEResponse(run.sse(), on_close=run.close)
        return await run.respond(request)

    async def start(self, req: ApiRequest) -> "_Run":
        """The request tokenized, admitted and started on the engine: its output side (read `pieces()` or `collect()`
        and `close()` it, or hand `sse()` to an SSEResponse)."""
        return (await self.start_choices(req, 1))[0]

    async def start_choices(self, req: ApiRequest, k: int) -> list["_Run"]:
        """`start` for k choices of one prompt (n, best_of): admitted together, the prompt counted once."""
        arrival = time.perf_counter()
        loop = asyncio.get_running_loop()
        b = self.backend
        if k > self.admission.max_running:
            raise bad_request(f"{'best_of' if req.best_of else 'n'}={k} is more choices than this server runs "
                              f"at once (--max-concurrent {self.admission.max_running})",
                              param="best_of" if req.best_of else "n")
        ids = await self.prompt_ids(req)
        budget = max_new_tokens(req, len(ids), b.engine_max_length)
        gen = generation_config(req, len(ids), budget, b.gen_defaults)
        calls_format = self.tools.response_format(req.tools, req.tool_choice)   # tools/chat.py
        if calls_format is not None and "response_format" not in gen:   # auto leaves the user's format alone
            gen["response_format"] = calls_format
        if req.best_of:
            gen["logprobs"] = True             # choices are ranked by their tokens' mean logprob
        try:
            slot = await self.admission.acquire(k)
        except Overloaded as e:
            raise ApiError(429, f"the server is overloaded ({e}); retry later", code="server_overloaded",
                           type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            status, started, error = await loop.run_in_executor(b.executor, b.start_choices, ids, gen, k,
                                                                req.image_inputs)
        except PoolUnavailable as e:
            slot.release()
            raise ApiError(503, e.message, code="unavailable") from None
        except BaseException:
            slot.release()
            raise
        if status != AsStatus.ALLSPARK_SUCCESS:
            slot.release()
            raise error_from_engine(status, error, req.kind)
        self.metrics.prompt_tokens.inc(len(ids))
        shares = SharedSlot(slot, k)
        out = ResponseBuilder(req.kind, req.model, self.token_text, req.top_logprobs, req.include_usage)
        return [_Run(self, req, ids, budget, Generation(b, handle, queue, self.reader), shares.share(), arrival,
                     out.for_choice(i)) for i, (handle, queue) in enumerate(started)]


class _Run:
    """The output side of one started request."""

    def __init__(self, serving: Serving, req: ApiRequest, prompt_ids: list[int], budget: int, gen: Generation,
                 slot, arrival: float, out: ResponseBuilder):
        b = serving.backend
        self.s, self.req, self.gen, self.slot, self.budget = serving, req, gen, slot, budget
        self.prompt_tokens = len(prompt_ids)
        self.prompt_ids, self.echo_pending = prompt_ids, req.echo     # completions' echo: the prompt comes first
        self.eos = set(b.eos_token_ids) | set(req.stop_token_ids)   # ends left out of the text
        self.tool_out = ChatToolOutput(serving.tools.parser(req.tools)) if tools_active(req.tools, req.tool_choice) \
            else None                           # tool calls read from the text (tools/chat.py)
        keep = serving.tools.detokenizer_skip_ids() if self.tool_out is not None else None
        self.detok = IncrementalDetokenizer(b.tokenizer, prompt_ids, skip_ids=self.eos | (keep or set()),
                                            keep_special=keep is not None)
        self.stops = StopMatcher(req.stop)
        self.out = out                          # its choice's builder: index, text offsets
        self.logprob_sum = 0.0                  # of its tokens, where the engine sends them (best_of's ranking)
        self.arrival, self.first, self.last = arrival, None, None
        self.n_tokens, self.last_token = 0, None
        self.finish_reason: Optional[str] = None
        self.error: Optional[ApiError] = None
        self._closed = False

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it becomes final; afterwards `finish_reason` or `error` is set."""
        while self.finish_reason is None and self.error is None:
            el = await self.gen.next()
            if el is None:
                text, matched = self.stops.feed(self.detok.flush())
                self._ended(matched)
                yield Piece(text + self.stops.flush())
                return
            if self.echo_pending:           # the first element carries the prompt's logprobs (echo.py)
                self.echo_pending = False
                yield Piece(echo_text(self.s.backend.tokenizer, self.req.prompt, self.prompt_ids),
                            echo_tokens(self.prompt_ids, el, self.req.logprobs))
            if self.budget == 0:            # max_tokens 0 with echo: the one token made is not returned
                continue
            now = time.perf_counter()
            self.first = self.first or now
            self.last = now
            ids = el.ids_from_generate
            self.n_tokens += len(ids)
            self.last_token = ids[-1]
            tokens = []
            self.logprob_sum += sum(el.token_logprobs_list or ())
            if self.req.logprobs and len(el.token_logprobs_list) == len(ids):
                tokens = [TokenLogprob(t, lp, list(top or [])) for t, lp, top in
                          zip(ids, el.token_logprobs_list, el.log_probs_list or [[]] * len(ids))]
            text, matched = self.stops.feed(self.detok.add(ids))
            if matched:
                self.finish_reason = "stop"
                self.gen.close()          # stop and release it on the engine now
            yield Piece(text, tokens)

    def _ended(self, stop_matched: bool) -> None:
        status = self.gen.status
        if stop_matched:
            self.finish_reason = "stop"
        elif status == GenerateRequestStatus.GenerateFinished:
            eos_end = self.last_token in self.req.stop_token_ids or (self.last_token in self.eos
                                                                     and not self.req.ignore_eos)
            self.finish_reason = "length" if (self.n_tokens >= self.budget and not eos_end) else "stop"
        elif self.gen.error and "client disconnected" in self.gen.error:
            self.finish_reason = "abort"
        else:
            lost = pool_failed(self.gen.error)
            self.error = ApiError(503 if lost else 500, f"generation failed ({status.name}): {self.gen.error}",
                                  code="unavailable" if lost else None)

    async def chunks(self) -> AsyncIterator[dict]:
        """This choice's stream chunks, its finishing one last; on an error none more, and `error` is set."""
        out = self.out
        if self.req.kind == "chat":
            yield out.chunk("", role=True)
        try:
            async for piece in self.pieces():
                if self.tool_out is not None:
                    for chunk in self._tool_chunks(self.tool_out.deltas(piece.text), piece.tokens):
                        yield chunk
                elif piece.text or piece.tokens:
                    yield out.chunk(piece.text, tokens=piece.tokens)
        except Exception as e:          # headers are sent: the error can only travel as an event
            log.exception("generation stream failed")
            self.error = ApiError(500, f"internal error: {e!r}")
        if self.error is None:
            if self.tool_out is not None:
                for chunk in self._tool_chunks(self.tool_out.finish(), []):
                    yield chunk
                self.finish_reason = self.tool_out.finish_reason(self.finish_reason)
            yield out.chunk(None if self.req.kind == "chat" else "", finish_reason=self.finish_reason)

    def _tool_chunks(self, deltas: list[dict], tokens: list[TokenLogprob]) -> list[dict]:
        """Chunks of OpenAI deltas (content or tool_calls); the piece's logprobs ride on the first."""
        chunks = []
        for delta in deltas or ([{}] if tokens else []):
            chunk = self.out.chunk(None, tokens=tokens)
            chunk["choices"][0]["delta"] = delta
            chunks.append(chunk)
            tokens = []
        return chunks

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chunks():
                yield sse(chunk)
            if self.error is not None:
                yield sse(self.error.body())
            elif self.req.include_usage:
                yield sse(self.out.usage_chunk(self.prompt_tokens, self.n_tokens))
            yield SSE_DONE
        finally:
            self.close()

    async def collect(self, request: Request) -> tuple[str, list[TokenLogprob]]:
        """The whole output (text, logprobs), read while watching that the client is still there; closes the run.
        Raises the generation's error; `finish_reason` "abort": the client left."""
        watchdog = asyncio.get_running_loop().create_task(self._watch_client(request))
        try:
            texts, tokens = [], []
            async for piece in self.pieces():
                texts.append(piece.text)
                tokens.extend(piece.tokens)
        finally:
            watchdog.cancel()
            self.close()
        if self.error is not None:
            raise self.error
        return "".join(texts), tokens

    async def respond(self, request: Request) -> Response:
        text, tokens = await self.collect(request)
        if self.finish_reason == "abort":
            return Response(status_code=499)       # nobody is listening
        return JSONResponse(self.out.body([self.choice(text, tokens)], self.prompt_tokens, self.n_tokens))

    def choice(self, text: str, tokens: list[TokenLogprob]) -> dict:
        """This choice's part of a whole response, from what `collect` returned."""
        if self.tool_out is None:
            return self.out.choice(text, self.finish_reason, tokens if self.req.logprobs else None)
        content, calls = self.tool_out.message(text)
        choice = self.out.choice(content, self.tool_out.finish_reason(self.finish_reason),
                                 tokens if self.req.logprobs else None)
        if calls:
            choice["message"]["tool_calls"] = [c.openai() for c in calls]
        return choice

    async def _watch_client(self, request: Request) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_CHECK_S)
            if await request.is_disconnected():
                self.gen.abort("client disconnected")
                return

    def close(self) -> None:
        """Release the engine request and the admission slot, record the metrics (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.gen.close()
        self.slot.release()
        reason = self.finish_reason or ("error" if self.error is not None else "abort")
        self.s.metrics.request_done(reason, self.prompt_tokens, self.n_tokens, self.arrival, self.first, self.last)
