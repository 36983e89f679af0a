"""Fused Triton kernels for a decoder layer's elementwise ops, one launch each: residual add + RMSNorm, rotary
(q and k together, optionally writing k and v straight into the span cache), silu·mul and gelu(tanh)·mul. Each
rounds to the activation dtype where its torch reference in allspark_server/compute/reference.py does (math in fp32 in
between), so the outputs match the references bit for bit except where the reference's own fp32 math differs
(the RMSNorm mean's summation order, exp in silu and gelu, 1 + tanh in torch's gelu). Owns the kernels and
launch wrappers only, not the backend choice; no launch reads tensor contents on the host (CUDA-graph safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from allspark_server.compute.cuda import pdl
from allspark_server.compute.cuda.pdl import allow_next, wait_for_previous

MAX_SILU_BLOCK = 1024   # silu·mul (and gelu·mul) columns per program
# Every launch passes enable_fp_fusion=False: with fusion, the compiler turns `round(x * c) + round(y * s)` into
# fma(x, c, round(y * s)) (even as bf16 fma on sm_90), skipping a rounding the torch reference does.


@triton.jit
def _round(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), still as fp32. SOFT_BF16 (the interpreter, whose
    fp32 -> bf16 cast truncates) rounds bf16 on the bits; the GPU's cast already rounds to nearest even."""
    if DTYPE == tl.float32:
        return x
    if SOFT_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _silu_mul_rounded(gate, up, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 gate and up (each already rounded to DTYPE) -> silu(gate) * up as ops.silu_mul_reference rounds it:
    torch's silu rounded, then the product rounded (as fp32 values)."""
    act = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE, SOFT_BF16)
    return _round(act * up, DTYPE, SOFT_BF16)


@triton.jit
def _gelu_tanh_mul_rounded(gate, up, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 gate and up (each already rounded to DTYPE) -> gelu(gate, approximate="tanh") * up as HF Gemma 2
    rounds it: the gelu rounded, then the product rounded (as fp32 values). The gelu is
    0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): the same function without
    the cancellation of 1 + tanh(u) at u << 0 (torch's fp32 loses most digits of gelu(x) for x < -4, values
    below ~1e-6), and the limits at +-inf fall out (x, or -0 where x^3 overflows)."""
    two_u = 1.5957691216057308 * (gate + 0.044715 * (gate * gate * gate))             # 2 sqrt(2 / pi) (..)
    act = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-two_u)), DTYPE, SOFT_BF16)
    return _round(act * up, DTYPE, SOFT_BF16)


@triton.jit
def _rotated(x, x_partner, c, s, sign, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """x * cos + rotate_half(x) * sin, elementwise in fp32: x_partner the element D/2 away, sign -1 on the first
    half of a head and +1 on the second; both products and the sum rounded to DTYPE, as rotary_reference does."""
    return _round(_round(x * c, DTYPE, SOFT_BF16) + sign * _round(x_partner * s, DTYPE, SOFT_BF16), DTYPE,
                  SOFT_BF16)


@triton.jit
def _normed_row(s, w, eps, H, S_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One row's weight * rmsnorm(s) as rms_norm_reference rounds it (fp32 values): s [BLOCK] the residual stream
    (already rounded to S_DTYPE, zeros past H), w the norm's weight in fp32."""
    mean_sq = tl.math.div_rn(tl.sum(s * s, 0), H * 1.0)
    normed = _round(s * tl.math.rsqrt(mean_sq + eps), S_DTYPE, SOFT_BF16)                   # [BLOCK]
    return _round(w * normed, OUT_DTYPE, SOFT_BF16)


@triton.jit
def _rms_norm_kernel(x, delta, residual, weight, out, s_out, eps, H, stride_x, stride_d, stride_r, stride_o, stride_s,
                     HAS_DELTA: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     SOFT_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program = one row: s = x + residual (rounded), normed = s * rsqrt(mean(s^2) + eps) (rounded), out =
    weight * normed (rounded). HAS_DELTA: x = x + delta (fp32, rounded to x's dtype) first, LoRA's deltas as the
    expand adds them (lora_grouped.py). PDL: the norm's weight is loaded before waiting for the kernel that writes
    x."""
    allow_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    w = tl.load(weight + offs, mask=ok, other=0.0).to(tl.float32)                           # [BLOCK]
    wait_for_previous(PDL)
    s = tl.load(x + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)               # [BLOCK]
    if HAS_DELTA:
        d = tl.load(delta + row * stride_d + offs, mask=ok, other=0.0)
        s = _round(s + d, x.dtype.element_ty, SOFT_BF16)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)    # [BLOCK]
        s = _round(s + r, s_out.dtype.element_ty, SOFT_BF16)
        tl.store(s_out + row * stride_s + offs, s.to(s_out.dtype.element_ty), mask=ok)
    y = _normed_row(s, w, eps, H, s_out.dtype.element_ty, out.dtype.element_ty, SOFT_BF16)
    tl.store(out + row * stride_o + offs, y.to(out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(s), s) with s = x + residual (or x itself, as the reference returns it); x, residual
    [T, H] with any row stride, weight [H]; one program per row. delta: fp32 [T, H] LoRA deltas added to x first
    (pending_delta.py), with a residual only."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == x.shape[-1:] and weight.is_contiguous()
    assert delta is None or (residual is not None and delta.shape == x.shape and delta.dtype == torch.float32
                             and delta.stride(-1) == 1)
    rows, h = x.shape
    if residual is None:
        s = x
        out = torch.empty(rows, h, dtype=torch.promote_types(weight.dtype, s.dtype), device=x.device)   # [T, H]
    else:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        out, s = norm_outputs(x, residual, weight)                                                  # [T, H] x 2
    if rows == 0:
        return out, s
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(rows,)](
        x, x if delta is None else delta, x if residual is None else residual, weight, out, s, eps, h, x.stride(0),
        0 if delta is None else delta.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        s.stride(0), HAS_DELTA=delta is not None, HAS_RESIDUAL=residual is not None, BLOCK=block,
        SOFT_BF16=_INTERPRETED, num_warps=norm_warps(block),
        enable_fp_fusion=False, **pdl.launch_options(x.device))
    return out, s


def norm_outputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    """(out, s): the buffers rms_norm(x, weight, eps, residual) returns, for kernels that compute it."""
    s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, s.dtype), device=x.device), s


def norm_warps(block: int) -> int:
    """The warps of a program that norms a row of `block` columns (its sum's order: kernels that norm a row
    alike take the same)."""
    return 16 if block >= 16384 else 8 if block >= 4096 else 4


@triton.jit
def _rotary_kernel(q, k, v, cos, sin, q_out, k_out, v_out, slots, H,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_vot, stride_voh,
                   HALF: tl.constexpr, BLOCK: tl.constexpr, STORE_KV: tl.constexpr, SOFT_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (token t, head): heads < H rotate q[t, head] into q_out[t, head]; the rest rotate k[t, head - H]
    into k_out row t, or (STORE_KV) row slots[t] of the flat cache, where v[t, head - H] is copied too.
    out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the output dtype."""
    allow_next(PDL)
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    if head < H:
        src = q + t * stride_qt + head * stride_qh
        dst = q_out + t * stride_qot + head * stride_qoh
    else:
        row = t
        if STORE_KV:
            row = tl.load(slots + t).to(tl.int64)
        src = k + t * stride_kt + (head - H) * stride_kh
        dst = k_out + row * stride_kot + (head - H) * stride_koh
        if STORE_KV:
            v_src = v + t * stride_vt + (head - H) * stride_vh
            v_dst = v_out + row * stride_vot + (head - H) * stride_voh
            for half in range(2):
                v_half = tl.load(v_src + half * HALF + offs, mask=ok)                            # [BLOCK]
                tl.store(v_dst + half * HALF + offs, v_half, mask=ok)
    x1 = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)                    # [BLOCK] x[:D/2]
    x2 = tl.load(src + HALF + offs, mask=ok, other=0.0).to(tl.float32)             # [BLOCK] x[D/2:]
    c1 = tl.load(cos + t * stride_ct + offs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + t * stride_ct + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + t * stride_st + offs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + t * stride_st + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    dt = dst.dtype.element_ty
    o1 = _rotated(x1, x2, c1, s1, -1.0, dt, SOFT_BF16)
    o2 = _rotated(x2, x1, c2, s2, 1.0, dt, SOFT_BF16)
    tl.store(dst + offs, o1.to(dt), mask=ok)
    tl.store(dst + HALF + offs, o2.to(dt), mask=ok)


def _launch_rotary(q, k, v, cos, sin, q_out, k_out, v_out, slots) -> None:
    """Check shapes and launch one (token, head) grid; k_out/v_out are [T or S*P, KVH, D]."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    assert k.shape == (tokens, kv_heads, d) and d % 2 == 0, f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert cos.shape[0] == sin.shape[0] == tokens and cos.shape[-1] == sin.shape[-1] == d
    assert cos.dtype == sin.dtype == q.dtype == k.dtype, "rotary tables must be in the activation dtype"
    for x in (q, k, v, cos, sin, q_out, k_out, v_out):
        assert x.stride(-1) == 1, "head dims must be contiguous"
    if tokens == 0:
        return
    _rotary_kernel[(tokens, heads + kv_heads)](
        q, k, v, cos, sin, q_out, k_out, v_out, slots, heads, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        cos.stride(0), sin.stride(0), *q_out.stride()[:2], *k_out.stride()[:2], *v_out.stride()[:2],
        HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), STORE_KV=slots is not None, SOFT_BF16=_INTERPRETED,
        num_warps=1 if d <= 128 else 2, enable_fp_fusion=False, **pdl.launch_options(q.device))


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, h, D], k [T, kvh, D] (views into the fused qkv output are fine) rotated by cos/sin [T, 1, D] ->
    new contiguous (q_out, k_out)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                                   # [T, h, D]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)                                   # [T, kvh, D]
    _launch_rotary(q, k, k, cos, sin, q_out, k_out, k_out, None)
    return q_out, k_out


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rotary(q, k) whose rotated k goes, with v [T, kvh, D] (or [T, kvh * D]), straight into flat slots [T]
    (span * P + offset) of caches [S, P, KVH, D], as store_kv_reference writes them -> rotated q [T, h, D]."""
    tokens, kv_heads, d = k.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, d), "cache shape"
    assert k_cache.dtype == v_cache.dtype == k.dtype == v.dtype, "unquantized caches in the activation dtype"
    assert slots.shape == (tokens,) and not slots.dtype.is_floating_point
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                                   # [T, h, D]
    _launch_rotary(q, k, v.reshape(tokens, kv_heads, d), cos, sin, q_out, k_cache.view(-1, kv_heads, d),
                   v_cache.view(-1, kv_heads, d), slots)
    return q_out


@triton.jit
def _silu_mul_kernel(gate_up, delta, out, inter, stride_g, stride_d, stride_o, BLOCK: tl.constexpr,
                     SOFT_BF16: tl.constexpr, PDL: tl.constexpr, GELU: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Program (row, column block): out = act(gate) * up with act(gate) rounded, then the product; act silu, or
    GELU the tanh approximation of gelu. HAS_DELTA: gate|up = gate|up + delta (fp32, rounded to their dtype)
    first, LoRA's deltas as the expand adds them (lora_grouped.py)."""
    allow_next(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(gate_up + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)       # [BLOCK]
    up = tl.load(gate_up + row * stride_g + inter + offs, mask=ok, other=0.0).to(tl.float32)     # [BLOCK]
    if HAS_DELTA:
        in_dt = gate_up.dtype.element_ty
        gate = _round(gate + tl.load(delta + row * stride_d + offs, mask=ok, other=0.0), in_dt, SOFT_BF16)
        up = _round(up + tl.load(delta + row * stride_d + inter + offs, mask=ok, other=0.0), in_dt, SOFT_BF16)
    dt = out.dtype.element_ty
    if GELU:
        y = _gelu_tanh_mul_rounded(gate, up, dt, SOFT_BF16)
    else:
        y = _silu_mul_rounded(gate, up, dt, SOFT_BF16)
    tl.store(out + row * stride_o + offs, y.to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """HF's act(gate) * up on the merged projection gate_up [T, 2I] (any row stride) -> [T, I]; delta: fp32
    [T, 2I] LoRA deltas added to gate_up first (pending_delta.py)."""
    return _act_mul(gate_up, gelu=False, delta=delta)


def gelu_tanh_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """HF Gemma 2's gelu(gate, approximate="tanh") * up on the merged projection gate_up [T, 2I] (any row
    stride) -> [T, I], rounded as silu_mul rounds (the activation, then the product); delta as silu_mul's."""
    return _act_mul(gate_up, gelu=True, delta=delta)


def _act_mul(gate_up: torch.Tensor, gelu: bool, delta: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up, act silu or (gelu) gelu's tanh approximation: one (row, column block) grid."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    assert delta is None or (delta.shape == gate_up.shape and delta.dtype == torch.float32 and delta.stride(-1) == 1)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)                  # [T, I]
    if rows == 0 or inter == 0:
        return out
    block = min(MAX_SILU_BLOCK, triton.next_power_of_2(inter))
    d = gate_up if delta is None else delta
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, d, out, inter, gate_up.stride(0), d.stride(0),
                                                        out.stride(0), BLOCK=block, SOFT_BF16=_INTERPRETED,
                                                        num_warps=4, enable_fp_fusion=False, GELU=gelu,
                                                        HAS_DELTA=delta is not None, **pdl.launch_options(out.device))
    return out


_INTERPRETED = not isinstance(_rms_norm_kernel, triton.JITFunction)   # decorated under TRITON_INTERPRET=1
