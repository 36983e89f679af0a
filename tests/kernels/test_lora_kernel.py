"""The native LoRA kernel (native/lora.cpp add_lora, through ops.lora_add_'s ext.lora_add) on its own: B laid out in
panels of output columns holding only their nonzero ranks (compute/step_binding.py lora_panels), checked against a
hand-worked layout; the deltas against float64 with PEFT's roundings, at the portable level and every AVX2 level this
CPU runs, for decode batches and prompt-sized steps, K with and without tails, a last panel that is not whole and part
boundaries inside a panel; and bit for bit, every row of a step equals the same row alone."""
from __future__ import annotations

import pytest
import torch
from quant_cases import needs_native

from allspark_server.compute import ops
from allspark_server.compute.lora_slots import LoraSlots
from allspark_server.compute.step_binding import LORA_PANEL, lora_panels, native_lora

pytestmark = needs_native
PARTS, PART_RANK = (40, 24, 24), 4          # a fused q|k|v of 88 output columns: 5 whole panels and half of one
NUM_SLOTS = 4


def levels() -> list[int]:
    return [ops.ISA_PORTABLE] + [isa for isa in (ops.ISA_AVX2, ops.ISA_AVX512) if isa <= ops.isa_level()]


def block_diagonal_b(g, dtype) -> torch.Tensor:
    """[88, 12]: each part's rows use only its own 4 ranks, as lora/shard.py stacks a fused projection's B."""
    b = torch.zeros(sum(PARTS), PART_RANK * len(PARTS))
    row = 0
    for j, n in enumerate(PARTS):
        b[row:row + n, j * PART_RANK:(j + 1) * PART_RANK] = torch.randn(n, PART_RANK, generator=g) * 0.3
        row += n
    return b.to(dtype)


def test_panels_hold_only_the_ranks_their_columns_use():
    b = block_diagonal_b(torch.Generator().manual_seed(1), torch.float32)
    packed, index = lora_panels(b)
    # worked by hand: q is columns 0-39 with ranks 0-3, k 40-63 with 4-7, v 64-87 with 8-11; panels of 16 columns
    want = [(0, 4), (0, 4), (0, 8), (4, 8), (8, 12), (8, 12)]
    assert LORA_PANEL == 16 and [tuple(r) for r in index[:, :2].tolist()] == want
    lens = [hi - lo for lo, hi in want]
    assert index[:, 2].tolist() == [16 * sum(lens[:p]) for p in range(len(want))]
    assert packed.shape == (sum(lens), 16)
    for p, (lo, hi) in enumerate(want):
        panel = packed[index[p, 2] // 16:index[p, 2] // 16 + hi - lo]
        cols = b[p * 16:(p + 1) * 16, lo:hi].t()
        assert torch.equal(panel[:, :cols.shape[1]], cols) and not panel[:, cols.shape[1]:].any()
    assert lora_panels(torch.zeros(20, 3))[1][:, :2].tolist() == [[0, 0], [0, 0]]    # no rank at all


def _slots(k: int, dtype) -> LoraSlots:
    g = torch.Generator().manual_seed(k)
    lora = LoraSlots(NUM_SLOTS, PART_RANK * len(PARTS), k, sum(PARTS))
    for slot in (0, 1, 3):                                 # slot 2 leaves this projection alone
        a = (torch.randn(PART_RANK * len(PARTS), k, generator=g) * 0.3).to(dtype)
        lora.set(slot, a, block_diagonal_b(g, dtype))
    return lora


def _reference(y, x, lora, row_slots, dtype) -> torch.Tensor:
    """float64, rounded where PEFT rounds: t = A x and B t in the activation dtype, then y + B t."""
    out = y.clone()
    for i, s in enumerate(row_slots):
        if s < 0 or lora.a[s] is None:
            continue
        t = (lora.a[s].double() @ x[i].double()).to(dtype).double()
        delta = (lora.b[s].double() @ t).to(dtype)
        out[i] = (y[i].double() + delta.double()).to(dtype)
    return out


def _add(y, x, lora, row_slots, isa):
    ext = ops.native()
    return ext.lora_add(y.clone(), x, native_lora(ext, lora), torch.tensor(row_slots), isa, ops.native_rows(x.dtype))


@pytest.mark.parametrize("isa", levels())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 100, 24])           # whole 32-element runs; 3 runs + 4 left; no run, 3 of 8
def test_deltas_match_float64_and_every_row_equals_it_alone(isa, dtype, k):
    g = torch.Generator().manual_seed(7)
    lora = _slots(k, dtype)
    for rows in (1, 5, 70, 300):
        row_slots = [(-1, 0, 1, 2, 3, 0, 0)[(i * 5 + rows) % 7] for i in range(rows)]
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = torch.randn(rows, sum(PARTS), generator=g).to(dtype)
        got = _add(y, x, lora, row_slots, isa)
        want = _reference(y, x, lora, row_slots, dtype)
        # fp32 sums against float64; bf16 may round a sum that sits on a rounding boundary to its neighbour
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(got[[i for i, s in enumerate(row_slots) if s in (-1, 2)]],
                           y[[i for i, s in enumerate(row_slots) if s in (-1, 2)]])
        for i in range(0, rows, max(1, rows // 9)):
            alone = _add(y[i:i + 1], x[i:i + 1], lora, row_slots[i:i + 1], isa)
            assert torch.equal(alone, got[i:i + 1]), (rows, i)


def test_panels_that_do_not_lay_out_b_are_refused():
    ext = ops.native()
    lora = _slots(24, torch.float32)
    d = native_lora(ext, lora)
    bad = ext.LoraSlots()
    bad.a, bad.b = d.a, d.b
    bad.b_panels = list(d.b_panels)
    index = d.b_panel_index[0].clone()
    index[1, 1] = 13                                       # more ranks than B has
    bad.b_panel_index = [index] + list(d.b_panel_index[1:])
    x, y = torch.zeros(1, 24), torch.zeros(1, sum(PARTS))
    with pytest.raises(RuntimeError, match="panel 1 lies outside"):
        ext.lora_add(y, x, bad, torch.tensor([0]), ops.isa_level(), 64)


def test_a_changed_slot_lays_out_its_own_panels_and_the_others_keep_theirs(monkeypatch):
    """native_lora after set / clear of one slot: only that slot's B is laid out again (the others' panels are the
    same tensors as before), and every slot's panels equal a fresh layout of its B."""
    import allspark_server.compute.step_binding as binding
    ext, g = ops.native(), torch.Generator().manual_seed(31)
    lora = _slots(24, torch.float32)
    first = native_lora(ext, lora)
    laid_out = []
    monkeypatch.setattr(binding, "lora_panels", lambda b: laid_out.append(b) or lora_panels(b))
    b2 = block_diagonal_b(g, torch.float32)
    lora.set(2, torch.randn(PART_RANK * len(PARTS), 24, generator=g), b2)
    second = native_lora(ext, lora)
    assert len(laid_out) == 1 and laid_out[0] is lora.b[2]
    for s in (0, 1, 3):
        assert second.b_panels[s] is first.b_panels[s] and second.b_panel_index[s] is first.b_panel_index[s]
    lora.clear(1)
    third = native_lora(ext, lora)
    assert len(laid_out) == 1 and third.b_panels[1] is None and third.b_panel_index[1] is None
    for s in (0, 2, 3):
        packed, index = lora_panels(lora.b[s])
        assert torch.equal(third.b_panels[s], packed) and torch.equal(third.b_panel_index[s], index), s
