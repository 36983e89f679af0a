"""Compute ops with a native fast path: the only importer of the native extension (native/*.cpp).

Each op has a torch reference (`*_reference`) that the native kernel is tested against and that
runs whenever the extension is unavailable or the shape does not suit it. Ops on CUDA tensors go to the
op of the same name in the CUDA backend (allspark_server/compute/cuda/cuda_ops.py). The ISA level the kernels use
(AVX-512 VNNI > AVX-512 > AVX2+FMA > portable) is read once from the CPU's flags (allspark_client/cpu_features.py);
ALLSPARK_NO_NATIVE=1 turns the native path off.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from allspark_client import settings
from allspark_client.cpu_features import cpu_flags
from allspark_server.compute import row_mode, step_binding
from allspark_server.compute.lora_slots import LoraRows, LoraSlots, lora_add_reference
from allspark_server.compute.reference import (
    ACT_MAX,
    decode_attention_reference,
    gelu_tanh_mul_reference,
    linear_reference,
    moe_route,
    prefill_attention_reference,
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
    store_kv_reference,
)
from allspark_server.compute.steps import Attention, Mlp
from allspark_server.quant.formats import FORMAT_IDS, QuantizedWeight

log = logging.getLogger(__name__)

# kernels test `isa >= ISA_AVX512` for AVX-512 code, so ISA_AVX512_VNNI (a path of its own only in the quantized
# GEMV, native/gemv_quant.cpp) runs every other kernel's AVX-512 path, and ISA_AVX512_BF16 (only in the decode
# attention over bf16 caches, native/span_attention.cpp) every other kernel's VNNI path
ISA_PORTABLE, ISA_AVX2, ISA_AVX512, ISA_AVX512_VNNI, ISA_AVX512_BF16 = 0, 1, 2, 3, 4
# each level by the CPU features that select it (isa_level)
ISA_FEATURES = {ISA_PORTABLE: "portable", ISA_AVX2: "avx2+fma", ISA_AVX512: "avx512f+bw+vl",
                ISA_AVX512_VNNI: "avx512-vnni", ISA_AVX512_BF16: "avx512-vnni+bf16"}
# largest number of rows of x the native linear takes; above it oneDNN's GEMM wins, sooner in bf16 where oneDNN
# has bf16 dot-product instructions (docs/performance.md, "The GEMV-to-GEMM handover")
NATIVE_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 4}


# batch-invariant mode (set_batch_invariant); None until first read from settings.BATCH_INVARIANT
_batch_invariant: bool | None = None


def batch_invariant() -> bool:
    """Whether a row's result must not depend on the other rows of its batch (settings.BATCH_INVARIANT)."""
    global _batch_invariant
    if _batch_invariant is None:
        _batch_invariant = settings.BATCH_INVARIANT.get()
    return _batch_invariant


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode on or off for this process, from the next op on (models installed afterwards: their native
    decode stacks take the mode's row limit). On: every row count takes the native linear kernels (no GEMM handover;
    quantized weights: x rounded to 16 bits as in decode), no batch-1 kernel with its own summation order, and
    prompt rows attend one by one as decode rows do."""
    global _batch_invariant
    _batch_invariant = bool(on)
    ext = native()
    if ext is not None:
        ext.set_batch_invariant(_batch_invariant)


def native_rows(dtype: torch.dtype, alone: bool | None = None) -> int:
    """Most rows of x the native dense linear takes in `dtype` (0: none): NATIVE_MAX_ROWS, unbounded in batch-invariant
    and alone-rows mode (row_mode.py). `alone`: whether alone-rows mode counts (None: whether it is on now); the
    decode stack, built once and run in both modes, is built with False and told per call (all_rows_native)."""
    if dtype not in NATIVE_MAX_ROWS:
        return 0
    alone = row_mode.alone() if alone is None else alone
    return 2 ** 62 if batch_invariant() or alone else NATIVE_MAX_ROWS[dtype]


@functools.lru_cache(maxsize=1)
def native():
    """The extension module, or None (not built, or disabled)."""
    if settings.NO_NATIVE.get():
        return None
    try:
        from allspark_server import _native
    except ImportError as e:
        # the text, not the exception: a kept log record (pytest's capture) would keep its traceback's frames alive,
        # the caller's too (f_back), and with them a model being installed
        log.warning("native kernels unavailable (%s); using the PyTorch path", str(e))
        return None
    # a step option one side has and the other lacks fails here, not as a wrong answer
    step_binding.check_fields(_native)
    _native.set_batch_invariant(batch_invariant())
    return _native


@functools.lru_cache(maxsize=1)
def isa_level() -> int:
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        if "avx512_vnni" not in flags:     # /proc/cpuinfo's spelling, whatever the source (cpu_features.py)
            return ISA_AVX512
        return ISA_AVX512_BF16 if "avx512_bf16" in flags else ISA_AVX512_VNNI
    if {"avx2", "fma"} <= flags:
        return ISA_AVX2
    return ISA_PORTABLE


def cpu_paths() -> dict[str, str]:
    """Every kernel choice this CPU's features make, each named by the features behind it: the native kernels' ISA
    level, the dtype of ATen's GEMM for bf16 prompt rows (gemm_dtype), the int8 GEMM of activate_quant prompt rows
    (int8_gemm_suits). Tests name their cases by these; a combination no run has met fails (test_cpu_kinds.py)."""
    level = isa_level()
    return {"isa": f"{level}:{ISA_FEATURES[level]}",
            "bf16_gemm": "bf16" if gemm_dtype(torch.bfloat16) == torch.bfloat16 else "fp32-widened",
            "int8_gemm": "amx_int8" if int8_gemm_available() else "dequantized"}


def describe() -> str:
    """Which kernels this process uses (resolves the native module and the ISA level once)."""
    if native() is None:
        return "PyTorch path (native module unavailable)"
    names = {ISA_AVX512_BF16: "AVX-512 VNNI + BF16", ISA_AVX512_VNNI: "AVX-512 VNNI", ISA_AVX512: "AVX-512",
             ISA_AVX2: "AVX2+FMA", ISA_PORTABLE: "portable C++"}
    return "native, " + names[isa_level()]


def cuda_backend():
    """The CUDA backend's ops module (imported on first use: CPU ranks never load it)."""
    from allspark_server.compute.cuda import cuda_ops
    return cuda_ops


def on_cuda(op):
    """An op whose first argument is a CUDA tensor runs the CUDA backend's op of the same name instead."""
    @functools.wraps(op)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        if x.is_cuda:
            return getattr(cuda_backend(), op.__name__)(x, *args, **kwargs)
        return op(x, *args, **kwargs)
    return dispatch


@on_cuda
def linear(x: torch.Tensor, w: "torch.Tensor | QuantizedWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias), x [M, K], w [N, K] dense or quantized; the native kernels stream w for small M
    (quantized: up to quant_native_rows(isa), decode batches, or every row count where the weight is
    native_at_any_rows (native/kernels.h); more rows dequantize w once for ATen's GEMM)."""
    ext = native()
    if isinstance(w, QuantizedWeight):
        if ext is None or x.dim() != 2 or x.dtype not in NATIVE_MAX_ROWS:
            return linear_reference(x, w, bias)
        nw = native_weight(w)
        if x.shape[0] <= ext.quant_native_rows(isa_level()) or row_mode.alone() or nw.native_at_any_rows(isa_level()):
            return ext.linear_quant(x, nw, bias, isa_level())
        if int8_gemm_suits(w, x.shape[0]):        # the codes as they are: no native QuantWeight needed
            return linear_int8_gemm(x, w, bias)
        return linear_dequantized(x, w, bias, nw)
    if (ext is None or x.dim() != 2 or x.shape[0] > native_rows(w.dtype)
            or x.dtype != w.dtype or not w.is_contiguous()):
        if w.dtype == x.dtype and gemm_dtype(x.dtype) != x.dtype:   # bf16 prefill without bf16 dot products
            if ext is not None and x.dim() == 2 and w.is_contiguous():
                return ext.linear_widened(x, w, bias, isa_level())      # widened a tile at a time
            return _gemm_in(gemm_dtype(x.dtype), x, w, bias).to(x.dtype)
        return F.linear(x, w, bias)
    return ext.linear_small_m(x, w, bias, isa_level())


@on_cuda
def lora_linear(x: torch.Tensor, w, bias, lora: LoraSlots | None, rows: LoraRows | None) -> torch.Tensor:
    """lora_add_(linear(x, w, bias), ...) as one op, which a GPU overlaps (cuda_ops.lora_linear)."""
    return lora_add_(linear(x, w, bias), x, lora, rows)


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora: LoraSlots | None, rows: LoraRows | None) -> torch.Tensor:
    """y [T, out] += each row's adapter delta B[s] . (A[s] . x) in place (lora_slots.py), where the projection has
    an adapter a row uses. On the host the native decode steps' add_lora (native/lora.cpp), else the reference."""
    if y.is_cuda:
        return cuda_backend().lora_add_(y, x, lora, rows) if cuda_backend().takes_lora(lora, rows) else y
    if lora is None or rows is None or lora.is_empty:
        return y
    ext = native()
    if ext is not None and x.dim() == 2 and x.dtype in NATIVE_MAX_ROWS and all(
            a is None or a.dtype == x.dtype for a in lora.a):
        return ext.lora_add(y, x, step_binding.native_lora(ext, lora), rows.slots, isa_level(), native_rows(x.dtype))
    return lora_add_reference(y, x, lora, rows, linear)


def linear_dequantized(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                       nw=None) -> torch.Tensor:
    """x @ dequant(w).T (+ bias) through ATen's GEMM on the dequantized weight: linear's path for more rows than the
    native kernel takes (prefill). `nw`: w's native form where the caller made it already."""
    ext = native()
    nw = native_weight(w) if nw is None else nw
    dtype = gemm_dtype(x.dtype)
    # activate_quant: x rounded to int8 per token here too, as the GEMV rounds it, straight into the GEMM's dtype
    xg = ext.round_rows(x, ACT_MAX[8], dtype, isa_level()) if w.act_bits == 8 else x
    if dtype == torch.float32:   # dequantized a tile at a time (native/kernels.h: linear_widened)
        return ext.linear_widened(xg, nw, bias, isa_level()).to(x.dtype)
    return _gemm_in(dtype, xg, ext.dequantize_weight(nw, dtype, isa_level()), bias).to(x.dtype)


# None: the int8 GEMM serves A8W8 prefill where the CPU has AMX int8 (int8_gemm_suits); True / False force it on or
# off (tests; benchmarks comparing both paths in one run)
INT8_GEMM: bool | None = None
# most rows of x for the int8 GEMM: above them dequantize + bf16 GEMM wins, since oneDNN's int8 GEMM does not speed
# up with more rows as its bf16 one does (benchmarks/results/int8-gemm-spr.json)
INT8_GEMM_MAX_ROWS = 512


def int8_gemm_suits(w: QuantizedWeight, rows: int) -> bool:
    """Prefill rows (up to INT8_GEMM_MAX_ROWS) of an activate_quant int8 weight with per-channel scales run as an
    int8 GEMM (linear_int8_gemm) on CPUs with AMX int8, where it beats dequantizing the weight for the bf16 GEMM
    (benchmarks/int8_gemm.py; benchmarks/results/int8-gemm-spr.json)."""
    if w.act_bits != 8 or w.fmt != "int8" or w.scales.shape[1] != 1 or rows > INT8_GEMM_MAX_ROWS:
        return False
    return int8_gemm_available()


def int8_gemm_available() -> bool:
    """The int8 GEMM runs on this CPU: AMX int8, unless INT8_GEMM says otherwise."""
    return INT8_GEMM if INT8_GEMM is not None else "amx_int8" in cpu_flags()


def linear_int8_gemm(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(w).T (+ bias) for an activate_quant int8 per-channel weight, as an int8 GEMM: x rounded per row
    to int8 exactly as the GEMV rounds it, the integer products summed exactly (torch._int_mm, oneDNN's int8 GEMM),
    then scaled once in fp32 (d[m] * s[n]) and rounded into x's dtype."""
    ext = native()
    q, d = ext.quantize_rows_int8(x, isa_level())
    acc = torch._int_mm(q, w.qweight.t())
    return ext.scale_int_mm(acc, d, w.scales, bias, x.dtype, isa_level())


def _gemm_in(dtype: torch.dtype, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """ATen's GEMM with x, w and the bias in `dtype` (a no-op conversion where they already are)."""
    return F.linear(x.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype))


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ATen's GEMM for many rows (prefill; a quantized weight is dequantized into it, a bf16 weight
    widened): bf16 only where the CPU has bf16 dot products, without which oneDNN's bf16 GEMM runs far slower than
    fp32 (docs/performance.md). bf16 products are exact in fp32 either way; only the summation order differs."""
    if dtype == torch.bfloat16 and not ({"avx512_bf16", "amx_bf16"} & cpu_flags()):
        return torch.float32
    return dtype


def native_weight(w: "torch.Tensor | QuantizedWeight"):
    """The form the native kernels take a linear weight in: a dense tensor as it is, a quantized one as a
    `_native.QuantWeight` (which checks its tensors' shapes and dtypes)."""
    if not isinstance(w, QuantizedWeight):
        return w
    return native().QuantWeight(w.qweight, w.scales, w.zeros, FORMAT_IDS[w.fmt], w.in_features, w.act_bits)


def native_weight_ok(w, dtype: torch.dtype) -> bool:
    """A weight the native kernels take next to activations of `dtype`: quantized, or dense in that dtype."""
    return isinstance(w, QuantizedWeight) or w.dtype == dtype


@on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one pass per row; x [T, H]."""
    ext = native()
    if ext is None or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps, residual)
    return ext.rms_norm(x, weight, eps, residual, isa_level())


@on_cuda
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both rotations in one call (q and k may be views into the fused qkv output)."""
    ext = native()
    if (ext is None or q.dtype not in (torch.float32, torch.bfloat16) or q.shape[-1] % 2
            or q.stride(-1) != 1 or k.stride(-1) != 1):
        return rotary_reference(q, k, cos, sin)
    return ext.rotary(q, k, cos, sin, isa_level())


@on_cuda
def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    k_param: torch.Tensor | None = None, v_param: torch.Tensor | None = None) -> torch.Tensor:
    """rotary(q, k), then store_kv of the rotated k and v into cache slots [T]: the rotated q (a prefill
    layer's rotation and cache write; on a GPU one launch for dense caches)."""
    q, k = rotary(q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slots, k_param, v_param)
    return q


def attention_options(scale: float, softcap: float = 0.0, window: int = 0):
    """The native attention kernels' options struct for these values (for calling the kernels directly)."""
    return step_binding.options(Attention(scale, softcap=softcap, window=window), native())


@on_cuda
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                     ctx: torch.Tensor, options: Attention, k_param: torch.Tensor | None = None,
                     v_param: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its spans; options: the layer's Attention step (scale, softcap, window), which
    reaches the kernel as its native AttentionOptions (compute/step_binding.py)."""
    ext = native()
    if ext is None or q.dtype not in (torch.float32, torch.bfloat16):
        return decode_attention_reference(q, k_cache, v_cache, spans, ctx, options, k_param, v_param, alibi_slopes)
    kernel_options = step_binding.options(options, ext)
    if k_param is not None:
        return ext.decode_attention_quant(q, k_cache, k_param, v_cache, v_param, spans, ctx, kernel_options,
                                          isa_level(), alibi_slopes)
    return ext.decode_attention(q, k_cache, v_cache, spans, ctx, kernel_options, isa_level(), alibi_slopes)


@on_cuda
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, options: Attention,
                      out: torch.Tensor, k_param: torch.Tensor | None = None, v_param: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """The multi-token chunks of `meta.seqs`, each on its own: the native kernel on AVX2 / AVX-512 (fp32 / bf16 caches,
    no ALiBi, soft cap or window), else ATen's SDPA (compute/reference.py); batch-invariant mode: each prompt row as a
    decode row over its own context, so it comes out the same in any chunk, cached prefix or batch."""
    ext, invariant = native(), batch_invariant()
    fast = (ext is not None and isa_level() >= ISA_AVX2 and k_param is None and alibi_slopes is None
            and not options.softcap and not options.window and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == q.dtype and ext.prefill_attention_supports(q.shape[-1]) and out.is_contiguous())
    if not (fast or invariant):
        return prefill_attention_reference(q, k_cache, v_cache, meta, options, out, k_param, v_param, alibi_slopes)
    for i, seq in enumerate(meta.seqs):
        rows, end = slice(seq.q_start, seq.q_start + seq.q_len), seq.context_slots.shape[0]
        if invariant:
            spans = meta.prefill_spans[i:i + 1].expand(seq.q_len, -1).contiguous()
            out[rows] = decode_attention(q[rows].contiguous(), k_cache, v_cache, spans,
                                         torch.arange(end - seq.q_len + 1, end + 1), options, k_param, v_param,
                                         alibi_slopes)
        else:   # native/prefill_attention.cpp: row i of a chunk at position ctx - q_len + i
            ext.prefill_attention(q[rows].contiguous(), k_cache, v_cache, seq.context_slots, out[rows], options.scale,
                                  isa_level())
    return out


@on_cuda
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ext = native()
    if ext is None or gate_up.dim() != 2 or gate_up.dtype not in (torch.float32, torch.bfloat16):
        return silu_mul_reference(gate_up)
    return ext.silu_mul(gate_up, isa_level())


@on_cuda
def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up on the merged [T, 2I] projection (Gemma's MLP), HF's roundings."""
    ext = native()
    if ext is None or gate_up.dim() != 2 or gate_up.dtype not in (torch.float32, torch.bfloat16):
        return gelu_tanh_mul_reference(gate_up)
    return ext.gelu_tanh_mul(gate_up, isa_level())


def act_mul(gate_up: torch.Tensor, options: Mlp) -> torch.Tensor:
    """An Mlp step's act(gate) * up (options.act: compute/steps.py ACTIVATIONS)."""
    return silu_mul(gate_up) if options.act == "silu" else gelu_tanh_mul(gate_up)


@on_cuda
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_param: torch.Tensor | None = None, v_param: torch.Tensor | None = None) -> None:
    ext = native()
    if k_param is not None:
        if ext is None or k.dtype not in (torch.float32, torch.bfloat16) or v.stride(-1) != 1:
            return store_kv_reference(k, v, k_cache, v_cache, slots, k_param, v_param)
        return ext.store_kv_quant(k, v.reshape(slots.shape[0], -1), k_cache, k_param, v_cache, v_param, slots)
    if ext is None or k.dtype != k_cache.dtype or v.dtype != k_cache.dtype or v.stride(-1) != 1:
        return store_kv_reference(k, v, k_cache, v_cache, slots)
    t = slots.shape[0]
    ext.store_kv(k, v.reshape(t, -1), k_cache, v_cache, slots)


# ---- mixture of experts (layers/experts.py) -----------------------------------------------------------------


def moe(x, router, experts, top_k, norm_topk_prob, shared=None, shared_gate=None) -> torch.Tensor:
    """The experts' weighted sum [T, H] (this rank's partial, before the allreduce), on any device through the
    dispatching linear and silu_mul (a prefill's tokens grouped by expert). experts: [(gate_up weight, down
    weight)] per expert; shared: the same for the shared expert."""
    lin, act = linear, silu_mul
    weights, ids = moe_route(lin(x, router), top_k, norm_topk_prob)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():                      # ascending
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate_up, down = experts[e]
        y = lin(act(lin(x[token], gate_up)), down)
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    if shared is not None:
        y = lin(act(lin(x, shared[0])), shared[1])
        out += torch.sigmoid(lin(x, shared_gate).float()) * y.float()
    return out.to(x.dtype)
