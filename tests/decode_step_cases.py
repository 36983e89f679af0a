"""Decode-step test cases shared by the native, ALiBi and quantized-weight tests: random layers of one shape bound as
the layer description's steps (compute/steps.py), the unfused op sequence they must equal, and the Python loop over
compute/step_ops.py that the native decode stack must equal bit for bit."""
from __future__ import annotations

import torch

from allspark_server.compute import ops, step_ops, steps


def _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g):
    hidden, inter, span_size, num_spans = heads * d + 8, 3 * d + 5, 16, 24

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    ctx = torch.tensor([1, 17, 33, 5, 60, 2, 31, 16, 9, 40][:rows])
    spans = torch.stack([torch.randperm(num_spans, generator=g)[:4] for _ in range(rows)])
    slots = torch.stack([spans[b, (c - 1) // span_size] * span_size + (c - 1) % span_size for b, c in enumerate(ctx)])
    angles = torch.rand(rows, d // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    return dict(
        x=rand(rows, hidden), residual=rand(rows, hidden), norm1=rand(hidden).abs() + 0.5,
        norm2=rand(hidden).abs() + 0.5, eps=1e-6, qkv_w=rand((heads + 2 * kv_heads) * d, hidden, scale=0.2),
        qkv_b=rand((heads + 2 * kv_heads) * d) if bias else None, o_w=rand(hidden, heads * d, scale=0.2),
        gate_up_w=rand(2 * inter, hidden, scale=0.2), gate_up_b=rand(2 * inter) if bias else None,
        down_w=rand(hidden, inter, scale=0.2), k_cache=rand(num_spans, span_size, kv_heads, d),
        v_cache=rand(num_spans, span_size, kv_heads, d), cos=emb.cos().to(dtype)[:, None],
        sin=emb.sin().to(dtype)[:, None], slots=slots, spans=spans, ctx=ctx, scale=d ** -0.5)


def _bound_layer(c, heads, kv_heads, k_cache, v_cache, alibi_slopes=None):
    """The case's layer as its layer description binds it (compute/steps.py): pre-norm, attention (rotary, or
    ALiBi where slopes are given), pre-norm, silu MLP, over the caches given."""
    attention = steps.Attention(scale=c["scale"], qkv_bias=c["qkv_b"] is not None,
                                position="rope" if alibi_slopes is None else "alibi")
    return [steps.BoundNorm(steps.Norm("input_layernorm"), c["norm1"], c["eps"]),
            steps.BoundAttention(attention, c["qkv_w"], c["qkv_b"], c["o_w"], heads, kv_heads, k_cache, v_cache,
                                 alibi_slopes=alibi_slopes),
            steps.BoundNorm(steps.Norm("post_attention_layernorm"), c["norm2"], c["eps"]),
            steps.BoundMlp(steps.Mlp(), c["gate_up_w"], c["gate_up_b"], c["down_w"])]


def _unfused_attention(h, c, k_cache, v_cache, heads, kv_heads):
    """The model's unfused op sequence of the attention step on normed rows h (each op native where it can be)."""
    b, d = h.shape[0], k_cache.shape[-1]
    q, k, v = ops.linear(h, c["qkv_w"], c["qkv_b"]).split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k = ops.rotary(q.view(b, heads, d), k.view(b, kv_heads, d), c["cos"], c["sin"])
    ops.store_kv(k, v, k_cache, v_cache, c["slots"])
    o = ops.decode_attention(q, k_cache, v_cache, c["spans"], c["ctx"], steps.Attention(c["scale"]))
    return ops.linear(o.reshape(b, heads * d), c["o_w"])


def _native_norm(x, residual, b):
    """The native NormStep (what the DecodeStack runs) directly: (normed, residual stream)."""
    return ops.native().norm_step(x, residual, step_ops.native_step(b), ops.isa_level())


def _python_decode_step(layers, final_norm, embedding, lm_head, ids, positions, c, cos_table, sin_table,
                        reduce=None, embed_scale=None):
    """A decode step as DecoderForCausalLM runs it without the DecodeStack, over the same bound steps: embedding
    rows (times embed_scale in their dtype), rope rows, each layer's steps through step_ops (each native where it
    can be) with reduce(partial, layer, part) after each sublayer, final norm, LM head -> fp32 logits."""
    x = torch.nn.functional.embedding(ids, embedding)
    if embed_scale is not None:
        x = x * torch.tensor(embed_scale, dtype=x.dtype)
    cos = sin = None
    if cos_table is not None:
        cos, sin = (t[positions].to(x.dtype).unsqueeze(1) for t in (cos_table, sin_table))
    residual = None
    for i, layer in enumerate(layers):
        part = 0
        for b in layer:
            if isinstance(b, steps.BoundNorm):
                x, residual = step_ops.norm_step(x, residual, b)
                continue
            if isinstance(b, steps.BoundAttention):
                x = step_ops.attention_step(x, b, c["slots"], c["spans"], c["ctx"], cos, sin)
            else:
                x = step_ops.mlp_step(x, b)
            x = x if reduce is None else reduce(x, i, part)
            part += 1
    return ops.linear(step_ops.norm_step(x, residual, final_norm)[0], lm_head).float()


def _fresh_caches(cases, caches):
    """Every layer's cache pages back to the case's starting pages (in place: the bound steps hold them)."""
    for c, (k, v) in zip(cases, caches):
        k.copy_(c["k_cache"])
        v.copy_(c["v_cache"])


def _gemma_layer(c, layer, heads, kv_heads, k_cache, v_cache):
    """A Gemma 2 decoder layer's steps over the case's tensors (norm3, norm4: its two sandwich norms): pre-norm,
    attention (scores soft-capped at 10, a sliding window of 8 keys on even layers, a scale other than
    head_dim ** -0.5), the post-attention sandwich norm (no residual add), the pre-MLP norm, the GELU-tanh MLP,
    the post-MLP sandwich norm."""
    attention = steps.Attention(scale=1.5 * c["scale"], qkv_bias=c["qkv_b"] is not None, softcap=10.0,
                                window=8 if layer % 2 == 0 else 0)
    return [steps.BoundNorm(steps.Norm("input_layernorm"), c["norm1"], c["eps"]),
            steps.BoundAttention(attention, c["qkv_w"], c["qkv_b"], c["o_w"], heads, kv_heads, k_cache, v_cache),
            steps.BoundNorm(steps.Norm("post_attention_layernorm", adds_residual=False), c["norm3"], c["eps"]),
            steps.BoundNorm(steps.Norm("pre_feedforward_layernorm"), c["norm2"], c["eps"]),
            steps.BoundMlp(steps.Mlp(act="gelu_tanh"), c["gate_up_w"], c["gate_up_b"], c["down_w"]),
            steps.BoundNorm(steps.Norm("post_feedforward_layernorm", adds_residual=False), c["norm4"], c["eps"])]
