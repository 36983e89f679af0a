"""A chat template renderer process (started by chat_template.py, which runs this file as a plain script).

Reads JSON lines on stdin: first the setup ({"template", "variables", "max_chars", "timeout_s", "memory_mb"}),
then one {"messages": [...], "tools": [...], "add_generation_prompt": bool (both optional)} per request;
answers each with one JSON line on stdout: {"ready": true} after the setup, then {"text": ...} or {"error": ...}
per request. Renders with transformers' render_jinja_template (what tokenizer.apply_chat_template calls: its
sandboxed jinja2 environment, its filters, the tokenizer's special tokens as variables), so the prompt is the
tokenizer's own.

This process never runs the template itself: each render runs in a child forked for it (a few milliseconds:
transformers is imported here once), under limits: killed past timeout_s, an address space of what this process
holds plus memory_mb, a CPU-time limit (so that a child outlives neither its budget nor this process by much), and
text longer than max_chars refused before it is sent. So this process stays small and answers every request, and a
render that went wrong leaves nothing behind. The template is compiled here once, after a child proved that its
compilation ends within the time limit, and under a tighter memory limit of this process's own (jinja2 folds
constant expressions while compiling: that is template code too), so that the children inherit it. This process waits
only on the server (stdin) and on a child (at most its budget), so it ends when the server is gone: stdin ends, or the
answer finds no reader.
Imports nothing of allspark: it runs as a plain script.
"""
import json
import math
import os
import resource
import select
import signal
import sys
import time

OWN_MB = 64       # this process's memory beyond its imports: compiling the template (jinja2 folds constants while
                  # compiling, and gives up on one that runs out of memory) takes no more here


def _send(obj) -> None:
    sys.stdout.buffer.write(_encode(obj) + b"\n")
    sys.stdout.buffer.flush()


def _encode(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _limit_memory(extra_mb: int) -> None:
    """Address space: what this process holds now plus extra_mb (a soft limit: a child may raise its own)."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + (extra_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _limit_child(setup: dict) -> None:
    """In a forked child: its memory (what it holds now plus memory_mb) and CPU time (the budget and a second)."""
    _limit_memory(setup["memory_mb"])
    cpu = math.ceil(setup["timeout_s"]) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or hard > cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _in_child(fn, setup: dict) -> dict:
    """fn()'s answer, computed in a forked child within the limits; an error when it runs out of time or dies."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                      # the child: compute, write, exit (no cleanup: the parent's state is not ours)
        code = 0
        try:
            os.close(r)
            _limit_child(setup)
            data = _encode(fn())
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + setup["timeout_s"]
    chunks, timed_out = [], False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"error": f"it did not finish within {setup['timeout_s']:g} s and was stopped", "timeout": True}
    try:
        return json.loads(b"".join(chunks).decode("utf-8", "surrogatepass"))
    except ValueError:
        if os.WIFSIGNALED(status):
            how = signal.Signals(os.WTERMSIG(status)).name
            if os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
                return {"error": f"it used up its CPU time ({how}) and was stopped", "timeout": True}
            return {"error": f"its render crashed ({how})"}
        return {"error": f"it needed more than the {setup['memory_mb']} MiB of memory a render may use"}


def _render(render, messages, setup, tools=None, add_generation_prompt=True) -> dict:
    try:
        rendered, _ = render(conversations=[messages], tools=tools, chat_template=setup["template"],
                             add_generation_prompt=add_generation_prompt, **setup["variables"])
        text = rendered[0]
    except MemoryError:
        return {"error": f"it needed more than the {setup['memory_mb']} MiB of memory a render may use"}
    except RecursionError:
        return {"error": "it recursed too deeply"}
    except Exception as e:    # the template's own raise_exception, a syntax error, a type error in it, ...
        return {"error": f"{type(e).__name__}: {e}"}
    if len(text) > setup["max_chars"]:
        return {"error": f"it rendered {len(text)} characters, more than the {setup['max_chars']} a prompt can hold"}
    return {"text": text}


def _compiles(compile_template, template: str) -> dict:
    try:
        compile_template(template)
        return {"ok": True}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> int:
    setup = json.loads(sys.stdin.buffer.readline())
    from transformers.utils import chat_template_utils
    render = chat_template_utils.render_jinja_template
    compile_template = getattr(chat_template_utils, "_compile_jinja_template", None)   # cached per template
    _limit_memory(OWN_MB)
    if compile_template is not None and _in_child(lambda: _compiles(compile_template, setup["template"]),
                                                  setup).get("ok"):
        _compiles(compile_template, setup["template"])
    _send({"ready": True})
    for line in sys.stdin.buffer:
        ask = json.loads(line)
        messages, tools, add = ask["messages"], ask.get("tools"), ask.get("add_generation_prompt", True)
        try:
            _send(_in_child(lambda: _render(render, messages, setup, tools, add), setup))
        except BrokenPipeError:      # the server is gone
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
