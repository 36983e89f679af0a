"""LoRA adapters on the decode steps (compute/lora_slots.py, native/decode_steps.cpp add_lora): rows of several adapters
and of the base model in one batch. The native steps equal the Python sequence on the same kernels (ops.linear plus
ops.lora_add_) bit for bit; the MLP step equals a float64 computation written here; the reference steps agree."""
from __future__ import annotations

import pytest
import torch
from decode_step_cases import _bound_layer, _decode_layer_case

from allspark_client import settings
from allspark_server.compute import ops, reference, step_ops
from allspark_server.compute.lora_slots import LoraRows, LoraSlots

pytestmark = pytest.mark.skipif(settings.NO_NATIVE.get(), reason="native path disabled")
NUM_SLOTS = 3


def _slots(g, dtype, out: int, inp: int, ranks: dict[int, int]) -> LoraSlots:
    """Adapters in some slots (rank per slot); the others empty."""
    lora = LoraSlots(NUM_SLOTS, max(ranks.values(), default=1), inp, out)
    for slot, r in ranks.items():
        lora.set(slot, (torch.randn(r, inp, generator=g) * 0.3).to(dtype), (torch.randn(out, r, generator=g) * 0.3)
                 .to(dtype))
    return lora


def _case(dtype, rows):
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d = 4, 2, 16
    c = _decode_layer_case(dtype, rows, heads, kv_heads, d, True, g)
    _, attention, _, mlp = _bound_layer(c, heads, kv_heads, c["k_cache"].clone(), c["v_cache"].clone())
    hidden, inter = c["x"].shape[1], c["down_w"].shape[1]
    attention.qkv_lora = _slots(g, dtype, c["qkv_w"].shape[0], hidden, {0: 8, 2: 5})
    attention.o_lora = _slots(g, dtype, hidden, heads * d, {2: 16})          # slot 0 leaves o alone
    mlp.gate_up_lora = _slots(g, dtype, 2 * inter, hidden, {0: 8, 2: 5})
    mlp.down_lora = _slots(g, dtype, hidden, inter, {0: 8, 2: 5})
    return c, attention, mlp


ROW_SLOTS = {1: [2], 3: [0, -1, 2], 6: [2, 0, -1, 0, 2, -1], 9: [0] * 9}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", list(ROW_SLOTS))
def test_native_lora_steps_equal_the_python_sequence(dtype, rows):
    c, attention, mlp = _case(dtype, rows)
    lora_rows = LoraRows.of(ROW_SLOTS[rows])
    x = c["x"]
    got = step_ops.mlp_step(x, mlp, lora_rows)
    assert mlp.native is not None
    gate_up = ops.lora_add_(ops.linear(x, c["gate_up_w"], c["gate_up_b"]), x, mlp.gate_up_lora, lora_rows)
    a = ops.silu_mul(gate_up)
    want = ops.lora_add_(ops.linear(a, c["down_w"]), a, mlp.down_lora, lora_rows)
    assert torch.equal(got, want)
    # without adapter rows the step is the plain one
    assert torch.equal(step_ops.mlp_step(x, mlp, None), step_ops.mlp_step(x, mlp, LoraRows.of([-1] * rows)
                                                                           or None))
    if dtype == torch.float32:    # the attention step against the reference step (the same math, other kernels)
        k0, v0 = attention.k_cache.clone(), attention.v_cache.clone()
        o = step_ops.attention_step(x, attention, c["slots"], c["spans"], c["ctx"], c["cos"], c["sin"], lora_rows)
        attention.k_cache.copy_(k0)
        attention.v_cache.copy_(v0)
        o_ref = reference.attention_step_reference(x, attention, c["slots"], c["spans"], c["ctx"], c["cos"],
                                                   c["sin"], lora_rows)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


def test_mlp_step_with_adapters_against_float64():
    c, _, mlp = _case(torch.float32, 6)
    slots = ROW_SLOTS[6]
    got = step_ops.mlp_step(c["x"], mlp, LoraRows.of(slots)).double()
    x = c["x"].double()
    for i, s in enumerate(slots):
        row = x[i]
        gu = c["gate_up_w"].double() @ row + c["gate_up_b"].double()
        if s >= 0:
            gu = gu + mlp.gate_up_lora.b[s].double() @ (mlp.gate_up_lora.a[s].double() @ row)
        inter = gu.shape[0] // 2
        a = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
        y = c["down_w"].double() @ a
        if s >= 0:
            y = y + mlp.down_lora.b[s].double() @ (mlp.down_lora.a[s].double() @ a)
        torch.testing.assert_close(got[i], y, rtol=1e-5, atol=1e-5)


def test_lora_slots_refuse_pairs_that_do_not_chain():
    lora = LoraSlots(2, 4, 3, 4)
    with pytest.raises(ValueError, match="do not chain"):
        lora.set(0, torch.zeros(4, 8), torch.zeros(8, 5))
    lora.set(1, torch.ones(2, 3), torch.ones(4, 2))
    a, b = lora.stacked()
    assert a.shape == (2, 2, 3) and b.shape == (2, 4, 2) and a[0].abs().sum() == 0 and a[1].sum() == 6
