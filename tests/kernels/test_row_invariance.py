"""Batch-invariant mode's kernels (ops.set_batch_invariant): each row of x comes out of ops.linear bit for bit as it
does alone, at every row count (decode batches and prompt rows, past the GEMV's usual row limit), dense and in every
quantized format and group the GEMV takes; each prompt row of a chunk attends exactly as the same row does as a
decode row. Results are also checked against a float64 computation of the same rounded operands."""
from __future__ import annotations

import pytest
import torch

from allspark_server.compute import ops
from allspark_server.compute.reference import round_activations_reference
from allspark_server.compute.steps import Attention
from allspark_server.quant.formats import QuantizedWeight, quantize
from allspark_server.step.inputs import AttentionMetadata, SeqAttention

pytestmark = pytest.mark.skipif(ops.native() is None, reason="batch-invariant mode needs the native kernels")

ROWS = [1, 2, 3, 4, 5, 8, 17, 40, 70]        # 70: past the VNNI kernel's 64 rows; 17: past the AVX2 kernel's 16
K, N = 256, 72


@pytest.fixture(autouse=True)
def invariant():
    before = ops.batch_invariant()
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(before)


def quantized(fmt: str, group: int, act_bits: int, seed: int) -> QuantizedWeight:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    q = quantize(w, fmt, group)
    return QuantizedWeight(q["qweight"], q["scales"], q.get("mins", q.get("zeros")), fmt, group, K, act_bits)


def assert_rows_alone(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    alone = torch.cat([ops.linear(x[i:i + 1], w, bias) for i in range(x.shape[0])])
    for m in ROWS:
        together = ops.linear(x[:m], w, bias)
        bad = (together != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad} of {m} differ from the same rows alone"
    return alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_alone(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROWS), K + 3, generator=g).to(dtype)        # K not a multiple of any vector width
    w = (torch.randn(N, K + 3, generator=g) * 0.05).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    y = assert_rows_alone(x, w, bias)
    want = x.double() @ w.double().T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt,group,act_bits", [
    ("uint4_min", 32, 16), ("uint4_min", 64, 16), ("int4", 32, 16), ("uint4", 128, 16), ("int4", -1, 16),
    ("int8", -1, 16), ("uint8", 32, 16), ("int8", -1, 8), ("int4", 32, 8), ("uint4_min", 32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_alone(fmt, group, act_bits, dtype):
    w = quantized(fmt, group, act_bits, seed=2)
    x = torch.randn(max(ROWS), K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = assert_rows_alone(x, w)
    # the same rounded x against the dequantized codes, in float64
    want = round_activations_reference(x, act_bits).double() @ w.dequantize().double().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


def test_limits_unbounded():
    """No handover to ATen's GEMM at any row count while the mode is on; off, the usual limits return."""
    assert ops.native().quant_native_rows(ops.isa_level()) >= 2 ** 62
    assert ops.native_rows(torch.bfloat16) >= 2 ** 62
    ops.set_batch_invariant(False)
    assert ops.native().quant_native_rows(ops.isa_level()) <= ops.native().QUANT_NATIVE_MAX_ROWS
    assert ops.native_rows(torch.bfloat16) == ops.NATIVE_MAX_ROWS[torch.bfloat16]


@pytest.mark.parametrize("options", [Attention(0.25), Attention(0.25, softcap=5.0, window=7)],
                         ids=["plain", "softcap_window"])
def test_prompt_rows_attend_as_decode_rows(options):
    """A chunk of 6 prompt rows after 13 cached tokens: each row equals the decode kernel's row with the same context,
    and the causal softmax a float64 computation gives."""
    g = torch.Generator().manual_seed(4)
    span, heads, kv_heads, d, cached, n = 8, 4, 2, 16, 13, 6
    k_cache = torch.randn(4, span, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(4, span, kv_heads, d, generator=g).bfloat16()
    spans = torch.tensor([[2, 0, 3]])
    end = cached + n
    slots = (spans[0][:, None] * span + torch.arange(span)).flatten()[:end]
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    meta = AttentionMetadata(slots[cached:], [SeqAttention(0, n, slots, None)], decode_rows=torch.empty(0),
                             decode_spans=torch.empty(0, 0), decode_ctx=torch.empty(0), prefill_spans=spans)
    out = ops.prefill_attention(q, k_cache, v_cache, meta, options, torch.empty_like(q))
    for j in range(n):
        row = ops.decode_attention(q[j:j + 1].contiguous(), k_cache, v_cache, spans, torch.tensor([cached + j + 1]),
                                   options)
        assert torch.equal(out[j], row[0]), j
        # float64: row j sees keys [max(0, p - window + 1), p] at its position p
        p = cached + j
        lo = max(0, p - options.window + 1) if options.window else 0
        keys = k_cache.reshape(-1, kv_heads, d)[slots[lo:p + 1]].double().repeat_interleave(heads // kv_heads, 1)
        vals = v_cache.reshape(-1, kv_heads, d)[slots[lo:p + 1]].double().repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hd,thd->ht", q[j].double(), keys) * options.scale
        if options.softcap:
            s = torch.tanh(s / options.softcap) * options.softcap
        want = torch.einsum("ht,thd->hd", torch.softmax(s, -1), vals)
        torch.testing.assert_close(out[j].double(), want, rtol=2e-2, atol=2e-2)
