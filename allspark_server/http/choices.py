"""n > 1 and best_of: the choices of one request, each an engine request of its own, answered as one response.

Streamed, every choice's chunks go out as they come (each carries its choice's `index`), then one usage chunk
counting the prompt once and every choice's tokens. Whole, the response lists the choices in index order; with
`best_of` the choices generated are ranked by their tokens' mean logprob and the best n returned (OpenAI's rule:
"the highest log probability per token"), usage counting every token generated. The choices hold one admission
slot of weight k together (SharedSlot), given back when the last one is released.

Owns the merging only; a choice's own flow (`_Run`: tokens, text, stop strings, finish) is serving.py's.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from allspark_server.http.responses import SSE_DONE, sse

_END = object()      # a choice's stream has ended


class SharedSlot:
    """One admission slot held by k choices: `share()` k times; the slot goes back when every share has."""

    def __init__(self, slot, k: int):
        self._slot, self._left = slot, k

    def share(self) -> "_Share":
        return _Share(self)

    def _done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._slot.release()


class _Share:
    def __init__(self, owner: SharedSlot):
        self._owner = owner

    def release(self) -> None:
        """Idempotent, as Slot.release."""
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner._done()


class ChoiceGroup:
    """The k started choices (serving.py's `_Run`s, index 0..k-1) of one request `req`."""

    def __init__(self, runs: list, req):
        self.runs, self.req = runs, req

    def close(self) -> None:
        for run in self.runs:
            run.close()

    async def sse(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run) -> None:
            try:
                async for chunk in run.chunks():
                    queue.put_nowait(chunk)
            finally:
                queue.put_nowait(_END)

        tasks = [asyncio.get_running_loop().create_task(pump(run)) for run in self.runs]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is _END:
                    left -= 1
                    if any(run.error is not None for run in self.runs):
                        break                  # one choice failed: the response fails
                    continue
                yield sse(item)
            error = next((run.error for run in self.runs if run.error is not None), None)
            if error is not None:
                yield sse(error.body())
            elif self.req.include_usage:
                yield sse(self.runs[0].out.usage_chunk(self.runs[0].prompt_tokens, self._completion_tokens()))
            yield SSE_DONE
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    async def respond(self, request: Request) -> Response:
        try:
            results = await asyncio.gather(*(run.collect(request) for run in self.runs), return_exceptions=True)
        finally:
            self.close()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if any(run.finish_reason == "abort" for run in self.runs):
            return Response(status_code=499)       # nobody is listening
        ranked = list(zip(self.runs, results))
        if self.req.best_of:
            ranked.sort(key=lambda pair: pair[0].logprob_sum / max(1, pair[0].n_tokens), reverse=True)
            ranked = ranked[:self.req.n]
        choices = []
        for index, (run, (text, tokens)) in enumerate(ranked):
            run.out = run.out.for_choice(index)
            choices.append(run.choice(text, tokens))
        first = self.runs[0]
        return JSONResponse(first.out.body(choices, first.prompt_tokens, self._completion_tokens()))

    def _completion_tokens(self) -> int:
        return sum(run.n_tokens for run in self.runs)
