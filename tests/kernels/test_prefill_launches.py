"""The prefill path's fewer launches: `ops.rotary_store_kv` (a prefill layer's rotation and cache write as one op;
on a GPU one Triton launch for dense caches) against rotary_reference then store_kv_reference, on the CPU's ops
and on the CUDA backend (the GPU, or CPU tensors under the Triton interpreter), dense and quantized caches; and
`move_together` (a step's input tensors sent to the GPU in one copy) against the tensors it packs."""
from __future__ import annotations

import pytest
import torch

from allspark_server.compute import ops
from allspark_server.quant import kv as kv_quant
from allspark_server.step.inputs import move_together

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def qkv_views(tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, device: str, seed: int):
    """q [T, h, D], k / v [T, kvh, D]: strided views into one fused [T, (h + 2 kvh) D] projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)


def rope_rows(tokens: int, d: int, dtype: torch.dtype, device: str):
    """cos / sin rows [T, 1, D] of positions 0..T-1 (rotate_half layout: the two halves share frequencies)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)[:, None, :]
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


def caches(num_slots: int, span_size: int, kv_heads: int, d: int, dtype: torch.dtype, mode: str | None, device: str):
    """(k_cache, v_cache, k_param, v_param): NaN-filled dense caches, or a quantized mode's codes and params."""
    shape = (num_slots // span_size, span_size, kv_heads, d)
    if mode is None:
        return (torch.full(shape, float("nan"), dtype=dtype, device=device),
                torch.full(shape, float("nan"), dtype=dtype, device=device), None, None)
    code = (torch.int8, d) if mode == "int8" else (torch.uint8, d // 2)
    k = torch.zeros(*shape[:3], code[1], dtype=code[0], device=device)
    param = torch.full((*shape[:3], 2), float("nan"), dtype=torch.float32, device=device)
    return k, k.clone(), param, param.clone()


def backend(name: str):
    if name == "ops":
        return ops.rotary_store_kv
    from allspark_server.compute.cuda import cuda_ops
    return cuda_ops.rotary_store_kv


@pytest.mark.parametrize("path", ["ops", "cuda_backend"])
@pytest.mark.parametrize("mode", [None, "int8", "uint4"], ids=["dense", "int8", "uint4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rotary_store_kv_equals_rotary_then_store(path, mode, dtype):
    device = DEVICE if path == "cuda_backend" else "cpu"
    tokens, heads, kv_heads, d, span_size = 11, 6, 2, 32, 4
    q, k, v = qkv_views(tokens, heads, kv_heads, d, dtype, device, seed=tokens + d)
    cos, sin = rope_rows(tokens, d, dtype, device)
    slots = torch.randperm(4 * span_size * 4, generator=torch.Generator().manual_seed(3))[:tokens].to(device)
    k_cache, v_cache, k_param, v_param = caches(64, span_size, kv_heads, d, dtype, mode, device)
    ref = [t if t is None else t.clone() for t in (k_cache, v_cache, k_param, v_param)]
    q_out = backend(path)(q, k, v, cos, sin, k_cache, v_cache, slots, k_param, v_param)
    ref_q, ref_k = ops.rotary_reference(q, k, cos, sin)
    ops.store_kv_reference(ref_k, v, *ref[:2], slots, *ref[2:])
    assert q_out.shape == (tokens, heads, d) and q_out.dtype == dtype
    torch.testing.assert_close(q_out, ref_q, rtol=0, atol=0)
    for out, want in zip((k_cache, v_cache, k_param, v_param), ref):
        if want is not None:            # written slots equal; unwritten ones still as they were (NaN included)
            torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    if mode is not None:                # the codes decode to the rotated k
        deq = kv_quant.dequantize_rows(k_cache.view(-1, kv_heads, k_cache.shape[-1])[slots],
                                       k_param.view(-1, kv_heads, 2)[slots], mode).float()
        err = (deq - ref_k.float()).abs().max().item()
        assert err <= (0.02 if mode == "int8" else 0.3) * ref_k.float().abs().max().item()


def test_move_together_packs_one_buffer_of_aligned_views():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 1 << 40, (7,), generator=gen), None, torch.randint(0, 99, (3, 5), generator=gen),
               torch.empty(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
               torch.randint(-5, 5, (1,), generator=gen), torch.randint(0, 9, (2, 3), generator=gen)]
    moved = move_together(tensors, torch.device("cpu"))        # the packing alone: views of the host buffer
    assert moved[1] is None
    base = moved[0].untyped_storage().data_ptr()
    for t, m in zip(tensors, moved):
        if t is None:
            continue
        assert m.shape == t.shape and m.dtype == torch.long and torch.equal(m, t)
        assert m.untyped_storage().data_ptr() == base and m.storage_offset() % 2 == 0   # one buffer, 16-byte starts
        assert m.is_contiguous()


def test_move_together_copies_other_dtypes_one_by_one():
    tensors = [torch.arange(3), torch.ones(2, dtype=torch.int32)]
    moved = move_together(tensors, torch.device("cpu"))
    assert moved[1].dtype == torch.int32 and torch.equal(moved[1], tensors[1]) and torch.equal(moved[0], tensors[0])


@needs_gpu
def test_forward_inputs_to_gpu_equal_the_host_tensors():
    from allspark_server.core.messages import ScheduledChunk
    from allspark_server.step.inputs import RequestMirror, build_forward_inputs
    mirrors = {1: RequestMirror(list(range(10, 47)), [3, 0, 5], 0), 2: RequestMirror(list(range(5, 25)), [1, 2], 19)}
    host = build_forward_inputs([ScheduledChunk(1, 37, True), ScheduledChunk(2, 1, True)], mirrors, 16)
    dev = host.to(torch.device("cuda"))
    pairs = [(host.input_ids, dev.input_ids), (host.positions, dev.positions), (host.sample_rows, dev.sample_rows)]
    pairs += [(getattr(host.attn, f), getattr(dev.attn, f)) for f in
              ("slot_mapping", "decode_rows", "decode_spans", "decode_ctx", "prefill_q_start", "prefill_q_len",
               "prefill_ctx", "prefill_spans")]
    for h, d in pairs:
        assert d.is_cuda and d.shape == h.shape and torch.equal(d.cpu(), h)
    assert dev.attn.prefill_max_q == host.attn.prefill_max_q == 37
