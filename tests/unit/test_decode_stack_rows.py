"""The native decode stack is built once and then runs plain steps and speculative verify steps alike (each verify
call says all_rows_native). Its own row limit must be the plain one even when a verify step, inside alone-rows mode,
is what first builds it: a stack built there sent every later step's rows, 32 streams' too, to the GEMV."""
from __future__ import annotations

import torch

from allspark_server.compute import ops, step_ops
from allspark_server.compute.row_mode import alone_rows


class FakeStack:
    def __init__(self, isa, native_rows, embed_scale):
        self.native_rows = native_rows

    def add_layer(self, steps):
        pass

    def set_ends(self, **ends):
        pass


def test_a_stack_built_in_alone_rows_mode_keeps_the_plain_row_limit(monkeypatch):
    monkeypatch.setattr(ops, "native", lambda: type("Ext", (), {"DecodeStack": FakeStack})())
    monkeypatch.setattr(ops, "native_weight", lambda w: w)
    monkeypatch.setattr(step_ops, "native_step", lambda b: b)
    monkeypatch.setattr(ops, "batch_invariant", lambda: False)
    embedding = torch.zeros(8, 4, dtype=torch.bfloat16)
    with alone_rows():
        assert ops.native_rows(torch.bfloat16) == 2 ** 62          # what the verify step's own ops take
        stack = step_ops.decode_stack([], None, embedding, [], embedding)
    assert stack.native_rows == ops.NATIVE_MAX_ROWS[torch.bfloat16]
    assert step_ops.decode_stack([], None, embedding, [], embedding).native_rows == stack.native_rows
