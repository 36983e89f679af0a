"""Triton's interpreter (TRITON_INTERPRET=1, the Triton tests without a GPU) without its redundant re-patching.

A kernel launch patches triton.language for the interpreter (every builtin of tl, tl.core, tl.math and the tensor
class wrapped, found by inspect.getmembers) and restores it when the launch ends. Each call of a @triton.jit helper
inside the kernel does the whole patching again (triton/runtime/interpreter.py, InterpretedFunction.__call__), for
every program and loop iteration, though the launch has already patched the same modules: what it sets then is
equivalent to what is there, and it is never restored. That was about a fifth of the interpreted kernels' time.
`skip_repatching()` leaves out a helper call's patching when the launch in progress patched every language module the
helper sees; anything else (a helper called outside a launch, one that sees a module the kernel does not) takes
Triton's own path. The kernels run as before: same code, same values."""
from __future__ import annotations

import inspect
import sys


def skip_repatching() -> bool:
    """Install the shortcut in this process's Triton interpreter, if it is loaded (once); whether it is now."""
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is None:
        return False
    if getattr(interp.InterpretedFunction.__call__, "skips_repatching", False):
        return True
    import triton.language as tl
    seen: dict[int, tuple] = {}

    def langs_of(fn) -> frozenset:
        """The language modules the function's globals hold: those _patch_lang(fn) patches."""
        if id(fn) not in seen:                     # fn kept in the entry: its id is not reused meanwhile
            seen[id(fn)] = (fn, frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and v in (tl, tl.core)))
        return seen[id(fn)][1]

    launches: list[frozenset] = []                 # the modules each launch in progress patched
    launch, call = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__

    def launch_noting(self, *args, **kwargs):
        launches.append(langs_of(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def call_in_launch(self, *args, **kwargs):
        if not launches or not langs_of(self.fn) <= launches[-1]:
            return call(self, *args, **kwargs)
        fn = self.rewrite()                        # InterpretedFunction.__call__ but for its _patch_lang(self.fn)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    call_in_launch.skips_repatching = True
    interp.GridExecutor.__call__ = launch_noting
    interp.InterpretedFunction.__call__ = call_in_launch
    return True
