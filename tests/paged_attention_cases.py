"""Shared by the Triton paged-attention tests (test_triton_kernels.py, test_triton_prefill.py, test_triton_gemma.py):
the device and tolerances, caches over shuffled span tables whose padding holds garbage span ids and whose
unowned slots hold NaN, their quantized form, the float64 / torch decode references and the closeness check.
Import it after TRITON_INTERPRET is set (tests/conftest.py sets it before any test file is imported)."""
from __future__ import annotations

import torch

from allspark_server.compute import ops
from allspark_server.compute.steps import Attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}    # max error / max |reference|
GARBAGE_SPAN = 10 ** 9          # span-table padding: any read through it faults (or reads far out of bounds)
SCALE = 0.1



def make_cache(lengths: list[int], kvh: int, d: int, span_size: int, dtype: torch.dtype, seed: int = 0,
               index_dtype: torch.dtype = torch.int32):
    """Caches [S, P, KVH, D] and spans [B, MAXS] for sequences of `lengths` tokens: spans shuffled, padding
    entries 0 or GARBAGE_SPAN, and NaN in every slot no sequence owns (spare spans, tails of last spans):
    a kernel that loads one of them unmasked turns its output NaN, even with a zero softmax weight."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // span_size) for n in lengths]
    num_spans = sum(counts) + 3                                             # 3 spare spans nobody owns
    k_cache = torch.randn(num_spans, span_size, kvh, d, generator=gen)    # [S, P, KVH, D]
    v_cache = torch.randn(num_spans, span_size, kvh, d, generator=gen)    # [S, P, KVH, D]
    spans = torch.zeros(len(lengths), max(counts) + 2, dtype=torch.int64)  # [B, MAXS]
    spans[:, 1::2] = GARBAGE_SPAN
    owned = torch.zeros(num_spans, span_size, dtype=torch.bool)            # [S, P]
    order = torch.randperm(num_spans, generator=gen).tolist()
    for b, (n, c) in enumerate(zip(lengths, counts)):
        spans[b, :c] = torch.tensor(order[:c])
        order = order[c:]
        owned.view(-1)[(spans[b, :c, None] * span_size + torch.arange(span_size)).view(-1)[:n]] = True
    for cache in (k_cache, v_cache):
        cache[~owned] = float("nan")
    return (k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), spans.to(DEVICE, index_dtype))


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Every element finite and within rel * max |ref| of the reference."""
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err:.3g} vs max |ref| {ref.abs().max().item():.3g}"


def decode_refs(q, k_cache, v_cache, spans, ctx):
    """(float64 reference, torch reference in q's dtype) of decode attention, on the CPU."""
    q, k_cache, v_cache, spans, ctx = (x.cpu() for x in (q, k_cache, v_cache, spans, ctx))
    exact = ops.decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), spans, ctx,
                                           Attention(SCALE))
    return exact, ops.decode_attention_reference(q, k_cache, v_cache, spans, ctx, Attention(SCALE))


def lengths_for(span_size: int) -> list[int]:
    return [1, span_size - 1, span_size, span_size + 1, 300]


def case_id(case) -> str:
    dtype, d, span_size, group = case
    return f"{str(dtype).split('.')[-1]}-D{d}-P{span_size}-G{group}"


def quantize_cache(cache: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache's rows as quantized spans (quant/kv.py's reference): (codes, params), with NaN scales in
    every slot the dense cache held NaN in (no sequence owns it), so an unmasked read shows."""
    from allspark_server.quant import kv as kv_quant
    dense = cache.cpu().float()
    unowned = torch.isnan(dense).any(-1)                                           # [S, P, KVH]
    codes, params = kv_quant.quantize_rows(torch.nan_to_num(dense), mode)
    params[unowned] = float("nan")
    return codes.to(DEVICE), params.to(DEVICE)
