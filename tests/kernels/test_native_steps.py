"""The native decode steps and the one-call decode stack against the unfused ops and the Python loop over
compute/step_ops.py: bit-equal outputs and cache pages, reduce calls in layer and sublayer order, a Gemma-style layer
through the stack."""
from __future__ import annotations

import pytest
import torch
from decode_step_cases import (
    _bound_layer,
    _decode_layer_case,
    _fresh_caches,
    _gemma_layer,
    _native_norm,
    _python_decode_step,
    _unfused_attention,
)

from allspark_client import settings
from allspark_server.compute import ops, reference, step_ops, steps

pytestmark = pytest.mark.skipif(settings.NO_NATIVE.get(), reason="native path disabled")


def _stack_ends(g, dtype, hidden, d, vocab, max_pos, rows, eps):
    """What a stack needs around its layers, drawn from `g`: rotary tables, final norm, LM head, and the step's ids."""
    angles = torch.rand(max_pos, d // 2, generator=g) * 50
    cos_table, sin_table = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    final_norm = steps.BoundNorm(steps.Norm("norm"), (torch.rand(hidden, generator=g) + 0.5).to(dtype), eps)
    lm_head = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype)
    return cos_table, sin_table, final_norm, lm_head, torch.randint(0, vocab, (rows,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_steps_equal_the_unfused_ops(dtype):
    """The native steps call the same kernels in the same order: the norm step bit-equal to ops.rms_norm, the
    attention step (and the cache pages it writes) and the MLP step bit-equal to the unfused sequence, for row
    counts on both sides of the native-GEMV limit; and (fp32) equal to the pure-torch reference steps."""
    g = torch.Generator().manual_seed(7)
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (6, 4, 4, 32, False),
                                           (9, 8, 2, 16, True)):
        c = _decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g)
        caches = {name: (c["k_cache"].clone(), c["v_cache"].clone()) for name in ("native", "unfused", "reference")}
        norm1, attention, norm2, mlp_step = _bound_layer(c, heads, kv_heads, *caches["native"])
        h, s = step_ops.norm_step(c["x"], c["residual"], norm1)
        native_h, native_s = _native_norm(c["x"], c["residual"], norm1)
        want_h, want_s = ops.rms_norm(c["x"], c["norm1"], c["eps"], c["residual"])
        assert torch.equal(h, want_h) and torch.equal(s, want_s)
        assert torch.equal(native_h, want_h) and torch.equal(native_s, want_s)
        o = step_ops.attention_step(h, attention, c["slots"], c["spans"], c["ctx"], c["cos"], c["sin"])
        assert attention.native is not None                                 # it ran the native step
        unfused = _unfused_attention(h, c, *caches["unfused"], heads, kv_heads)
        assert torch.equal(o, unfused)
        assert all(torch.equal(a, b) for a, b in zip(caches["native"], caches["unfused"]))
        assert not torch.equal(caches["native"][0], c["k_cache"])          # the new keys were written

        h2, s2 = step_ops.norm_step(o, s, norm2)
        mlp = step_ops.mlp_step(h2, mlp_step)
        assert mlp_step.native is not None
        assert torch.equal(mlp, ops.linear(ops.silu_mul(ops.linear(h2, c["gate_up_w"], c["gate_up_b"])),
                                           c["down_w"]))
        assert all(torch.equal(a, b) for a, b in zip(_native_norm(o, s, norm2), (h2, s2)))
        # a sandwich norm (no residual add): the stream passes through untouched
        sandwich = steps.BoundNorm(steps.Norm("post_attention_layernorm", adds_residual=False), c["norm2"], c["eps"])
        normed, stream = _native_norm(o, s, sandwich)
        assert torch.equal(normed, ops.rms_norm(o, c["norm2"], c["eps"])[0]) and torch.equal(stream, s)
        assert all(torch.equal(a, b) for a, b in zip(step_ops.norm_step(o, s, sandwich), (normed, s)))

        if dtype == torch.float32:   # the reference steps on the reference norms
            hr, sr = reference.rms_norm_reference(c["x"], c["norm1"], c["eps"], c["residual"])
            ref_attention = _bound_layer(c, heads, kv_heads, *caches["reference"])[1]
            ref = reference.attention_step_reference(hr, ref_attention, c["slots"], c["spans"], c["ctx"], c["cos"],
                                                     c["sin"])
            assert (o - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
            h2r = reference.rms_norm_reference(o, c["norm2"], c["eps"], s)[0]
            ref_mlp = reference.mlp_step_reference(h2r, mlp_step)
            assert (mlp - ref_mlp).abs().max().item() <= 1e-4 * max(1.0, ref_mlp.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_equals_the_python_step(dtype):
    """DecodeStack.run (a whole decode step in one native call) gives bit-equal logits, and writes the same
    cache pages, as the Python path over the same bound steps: embedding and rope rows, the loop over the steps,
    final norm, LM head; with no reduce and with a reduce callable (called in layer order, o projection then down
    projection); an exception raised by the callable reaches the caller."""
    g = torch.Generator().manual_seed(11)
    vocab, max_pos = 50, 64
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 8, 2, 16, False)):
        cases = [_decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g) for _ in range(3)]
        first = cases[0]
        hidden = first["x"].shape[1]
        embedding = torch.randn(vocab, hidden, generator=g).to(dtype)
        cos_table, sin_table, final_norm, lm_head, ids = _stack_ends(g, dtype, hidden, d, vocab, max_pos, rows,
                                                                     first["eps"])
        positions = first["ctx"] - 1

        stack_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        loop_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        stack = step_ops.decode_stack([_bound_layer(c, heads, kv_heads, k, v)
                                       for c, (k, v) in zip(cases, stack_caches)],
                                      final_norm, embedding, [(cos_table, sin_table)], lm_head)
        assert stack is not None and stack.num_layers == 3
        loop_layers = [_bound_layer(c, heads, kv_heads, k, v) for c, (k, v) in zip(cases, loop_caches)]

        def scaled(t, layer, part):          # stands in for an allreduce: any function of (partial, layer, part)
            calls.append((layer, part))
            return t * (2 + layer + part)

        for reduce in (None, scaled):
            calls = []
            _fresh_caches(cases, loop_caches)
            expected = _python_decode_step(loop_layers, final_norm, embedding, lm_head, ids, positions, first,
                                           cos_table, sin_table, reduce)
            expected_calls, calls = calls, []
            _fresh_caches(cases, stack_caches)                  # the same starting pages as the loop's
            logits = stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], reduce)
            assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
            assert torch.equal(logits, expected)
            assert all(torch.equal(a, b) for pair_s, pair_l in zip(stack_caches, loop_caches)
                       for a, b in zip(pair_s, pair_l))
            assert calls == expected_calls == ([] if reduce is None else [(i, p) for i in range(3) for p in (0, 1)])

        def failing(t, layer, part):
            raise ValueError(f"reduce failed at layer {layer}")
        with pytest.raises(ValueError, match="reduce failed at layer 0"):
            stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], failing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_runs_a_gemma_layer_as_the_python_step(dtype):
    """The stack runs whatever steps a layer is described as, not one fixed layer shape: Gemma 2's six steps
    (sandwich NormSteps without the residual add after the attention and after the MLP, an MlpStep with
    GELU-tanh, soft-capped and windowed attention) and its scaled embeddings give logits and cache pages bit-equal
    to the Python loop over step_ops on the same bound steps; reduce is called once per sublayer (the norms are
    not parts)."""
    g = torch.Generator().manual_seed(13)
    vocab, max_pos = 50, 64
    for rows, heads, kv_heads, d, bias in ((1, 4, 2, 16, False), (3, 6, 1, 24, True), (9, 8, 2, 16, False)):
        cases = [_decode_layer_case(dtype, rows, heads, kv_heads, d, bias, g) for _ in range(3)]
        first = cases[0]
        hidden = first["x"].shape[1]
        for c in cases:
            c["norm3"], c["norm4"] = ((torch.rand(hidden, generator=g) + 0.5).to(dtype) for _ in range(2))
        embed_scale = hidden ** 0.5                                         # Gemma's sqrt(hidden)
        embedding = (torch.randn(vocab, hidden, generator=g) / embed_scale).to(dtype)
        cos_table, sin_table, final_norm, lm_head, ids = _stack_ends(g, dtype, hidden, d, vocab, max_pos, rows,
                                                                     first["eps"])
        positions = first["ctx"] - 1

        stack_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        loop_caches = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
        stack = step_ops.decode_stack([_gemma_layer(c, i, heads, kv_heads, k, v)
                                       for i, (c, (k, v)) in enumerate(zip(cases, stack_caches))],
                                      final_norm, embedding, [(cos_table, sin_table)], lm_head,
                                      embed_scale)
        assert stack is not None and stack.num_layers == 3
        loop_layers = [_gemma_layer(c, i, heads, kv_heads, k, v)
                       for i, (c, (k, v)) in enumerate(zip(cases, loop_caches))]

        def scaled(t, layer, part):
            calls.append((layer, part))
            return t * (2 + layer + part)

        for reduce in (None, scaled):
            calls = []
            _fresh_caches(cases, loop_caches)
            expected = _python_decode_step(loop_layers, final_norm, embedding, lm_head, ids, positions, first,
                                           cos_table, sin_table, reduce, embed_scale)
            if reduce is None:
                unreduced = expected
            expected_calls, calls = calls, []
            _fresh_caches(cases, stack_caches)
            logits = stack.run(ids, positions, first["slots"], first["spans"], first["ctx"], reduce)
            assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
            assert torch.equal(logits, expected)
            assert all(torch.equal(a, b) for pair_s, pair_l in zip(stack_caches, loop_caches)
                       for a, b in zip(pair_s, pair_l))
            assert calls == expected_calls == ([] if reduce is None else [(i, p) for i in range(3) for p in (0, 1)])
        # the sandwich norms are applied: the same steps without them give other logits
        plain = [[b for b in layer if not (isinstance(b, steps.BoundNorm) and not b.step.adds_residual)]
                 for layer in loop_layers]
        _fresh_caches(cases, loop_caches)
        assert not torch.equal(_python_decode_step(plain, final_norm, embedding, lm_head, ids, positions, first,
                                                   cos_table, sin_table, None, embed_scale), unreduced)
