"""Chat templates rendered off the server's threads, within a time and a size budget.

A chat template is code that comes with the model (tokenizer_config.json, chat_template.jinja, a GGUF file's
tokenizer.chat_template): two nested loops over range(100000) never end, and a template can render gigabytes.
jinja2's sandbox keeps a template away from Python's internals, not from running long or allocating, and a Python
thread stuck in a render cannot be stopped: rendered on the server's threads, ten such requests took every one of
them. So templates render in worker processes (template_worker.py), each one request at a time, on threads of
their own here (`executor`), so that nothing else waits on a render. A worker forks a child for each render and
kills it past `timeout_s`; the child's memory and CPU time are limited, and text longer than `max_chars` (more than
the longest prompt can hold) is refused there, before it is sent back or tokenized. A failure raises
TemplateFailed, which the server answers with a 400 naming the chat template.

A process rather than a budget inside jinja2 (a counting `range`, a bounded output stream): those bound only what
they count, while string repetition, filters, constant folding at compile time and deep recursion cost time and
memory too; only a process can be stopped whatever it does. A fork per render rather than a worker killed and
started again: the fork costs milliseconds (transformers is imported once, in the worker), a fresh interpreter a
second or more, and nothing a render did outlives it. Rendering is transformers' render_jinja_template, what
tokenizer.apply_chat_template calls, so the prompt is the tokenizer's own.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

log = logging.getLogger("allspark.http")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")
RENDER_TIMEOUT_S = 5.0      # a render's time budget (allspark-serve --chat-template-timeout)
RENDER_WORKERS = 2          # renders at once; more chat requests wait for one of these
RENDER_MEMORY_MB = 512      # memory a render may take beyond what its worker holds
START_TIMEOUT_S = 120.0     # a worker's start (importing transformers' template code) on a loaded machine
GRACE_S = 10.0              # beyond the budget, before a worker that does not answer is killed (it kills renders)


class TemplateFailed(Exception):
    """The chat template failed, ran out of time or memory, or rendered too much, on one request's messages."""


def continued(text: str, final: str) -> str:
    """A rendering (without generation prompt) cut right after the final message's text, so that the model goes on
    writing that message (transformers' continue_final_message does the same); TemplateFailed when the template
    did not render that text as it is."""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise TemplateFailed("the chat template does not render the final assistant message's text as it is, so it "
                             "cannot be continued")
    return text[:at + len(final.strip())]


def template_source(model_path: str) -> str:
    """Where a model's chat template comes from, as error messages name it."""
    if model_path.endswith(".gguf"):
        return f"the chat template (tokenizer.chat_template) of {os.path.basename(model_path)}"
    if os.path.isfile(os.path.join(model_path, "chat_template.jinja")):
        return f"the chat template (chat_template.jinja) of {model_path}"
    return f"the chat template (tokenizer_config.json's chat_template) of {model_path}"


def template_variables(tokenizer) -> dict:
    """The variables apply_chat_template gives a template besides the messages: the special tokens."""
    out = {}
    for key, value in tokenizer.special_tokens_map.items():
        if isinstance(value, (list, tuple)):
            out[key] = [str(v) for v in value]
        elif value is not None:
            out[key] = str(value)
    return out


class _Worker:
    """One renderer process: started, told the template, and ready when this returns."""

    def __init__(self, setup: dict):
        # run as a plain script, with neither its own directory (http/: modules named like stdlib ones could shadow
        # them) nor the current directory on sys.path (`python -P`, but also on Python 3.10)
        code = f"import runpy, sys; del sys.path[0]; runpy.run_path({WORKER!r}, run_name='__main__')"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True)
        self._buf = b""
        self.send(setup)
        reply = self.receive(time.monotonic() + START_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            self.kill()
            raise RuntimeError(f"the chat template renderer ({WORKER}) did not start: {self._ended()}")

    def send(self, obj) -> bool:
        try:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except OSError:               # it is gone (BrokenPipeError)
            return False

    def receive(self, deadline: float) -> Optional[dict]:
        """Its next answer; None when it ended or the deadline passed first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line.decode("utf-8", "surrogatepass"))

    def _ended(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "it did not answer"
        return f"it exited with {code}" if code >= 0 else f"it was killed by signal {-code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class TemplateRenderer:
    """Renders one chat template for many requests: `render(messages)` on `executor` (blocking), or
    `await render_async(messages)`. Up to `workers` worker processes, started on first use (`warm()` starts one
    ahead, and a worker that failed is replaced in the background); `close()` ends them."""

    def __init__(self, template: str, variables: dict, max_chars: int, *, source: str = "the chat template",
                 timeout_s: float = RENDER_TIMEOUT_S, workers: int = RENDER_WORKERS,
                 memory_mb: int = RENDER_MEMORY_MB):
        if not timeout_s > 0:
            raise ValueError(f"the chat template's time budget must be > 0 seconds, got {timeout_s}")
        self.source, self.timeout_s, self.max_chars, self.workers = source, timeout_s, max_chars, workers
        self._setup = {"template": template, "variables": variables, "max_chars": max_chars, "timeout_s": timeout_s,
                       "memory_mb": memory_mb}
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="allspark-chat-template")
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()          # alive, idle or rendering
        self._idle: list[_Worker] = []
        self._closed = False

    def _start(self) -> _Worker:
        w = _Worker(self._setup)
        with self._lock:
            if not self._closed:
                self._all.add(w)
                return w
        w.kill()
        raise RuntimeError("the server is shutting down")

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.poll() is None:
                    return w
                self._all.discard(w)
        return self._start()

    def _give_back(self, w: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(w)
                return
        w.kill()

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def warm(self) -> None:
        """Start a worker in the background (on `executor`) unless `workers` are running already."""
        def start():
            with self._lock:
                if self._closed or self._idle or len(self._all) >= self.workers:
                    return
            try:
                self._give_back(self._start())
            except Exception as e:
                if not self._closed:
                    log.warning("the chat template renderer did not start: %s", e)
        try:
            self.executor.submit(start)
        except RuntimeError:          # closed
            pass

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True
               ) -> str:
        """The prompt text of `messages` (generation prompt added; `tools`: the template's `tools` variable);
        TemplateFailed when the template fails, takes longer than timeout_s, runs out of memory or renders more
        than max_chars characters."""
        w = self._take()
        ask = {"messages": messages, **({"tools": tools} if tools else {}),
               **({} if add_generation_prompt else {"add_generation_prompt": False})}   # /tokenize may leave it out
        reply = w.receive(time.monotonic() + self.timeout_s + GRACE_S) if w.send(ask) else None
        if reply is None:                         # the worker itself failed: not the template's doing, as far as
            ended = w._ended()                    # we know; a new one takes its place
            self._drop(w)
            self.warm()
            raise RuntimeError(f"the chat template renderer ({WORKER}) failed: {ended}")
        self._give_back(w)
        if "error" in reply:
            raise TemplateFailed(f"{self.source} failed on these messages: {reply['error']}")
        return reply["text"]

    async def render_async(self, messages: list[dict], tools: Optional[list[dict]] = None,
                           add_generation_prompt: bool = True) -> str:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.render, messages, tools,
                                                                add_generation_prompt)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()
        self.executor.shutdown(wait=False, cancel_futures=True)
