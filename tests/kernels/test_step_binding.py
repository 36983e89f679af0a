"""The step binder (compute/step_binding.py): native/steps.h's field lists as the extension was built from them, the
check against compute/steps.py failing on each kind of mismatch, and descriptors filled by name."""
from __future__ import annotations

import os
import re
import types

import pytest
import torch

from allspark_server.compute import ops, step_binding, step_ops, steps

NATIVE = os.path.join(os.path.dirname(__file__), "..", "..", "native")
NATIVE_NAMES = {"NormStep": "NORM_STEP", "AttentionStep": "ATTENTION_STEP", "MlpStep": "MLP_STEP",
                "MoeStep": "MOE_STEP", "AttentionOptions": "ATTENTION_OPTION"}


def header_fields() -> dict[str, list[tuple[str, str]]]:
    """Each struct's F(type, name) list, read from the headers' text (steps.h, step_options.h): a list that names
    another list (ATTENTION_OPTION_FIELDS(F) inside ATTENTION_STEP_FIELDS) holds its fields there."""
    text = "".join(open(os.path.join(NATIVE, h)).read() for h in ("steps.h", "step_options.h")).replace("\\\n", " ")

    def fields(macro: str) -> list[tuple[str, str]]:
        body = re.search(rf"#define {macro}_FIELDS\(F\)(.*)", text).group(1)
        out = []
        for ctype, name, nested in re.findall(r"F\(([^,]+),\s*(\w+)\)|(\w+)_FIELDS\(F\)", body):
            out += fields(nested) if nested else [(name, ctype.strip())]
        return out
    return {struct: fields(macro) for struct, macro in NATIVE_NAMES.items()}


def fake_ext(fields: dict[str, list[tuple[str, str]]]):
    return types.SimpleNamespace(**{name: types.SimpleNamespace(FIELDS=f) for name, f in fields.items()})


def test_header_lists_every_struct_and_the_python_side_agrees():
    fields = header_fields()
    assert set(fields) == set(NATIVE_NAMES) and all(fields.values())
    assert ("softcap", "double") in fields["AttentionStep"] and ("activation", "int64_t") in fields["MlpStep"]
    assert fields["AttentionOptions"] == [("scale", "double"), ("softcap", "double"), ("window", "int64_t")]
    assert set(fields["AttentionOptions"]) <= set(fields["AttentionStep"])     # the step holds its kernels' options
    step_binding.check_fields(fake_ext(fields))     # compute/steps.py as it is: no complaint


@pytest.mark.skipif(ops.native() is None, reason="native extension not built")
def test_the_built_extension_has_the_headers_fields():
    """A stale build (steps.h changed, extension not rebuilt) shows up here."""
    built = {name: [tuple(f) for f in getattr(ops.native(), name).FIELDS] for name in NATIVE_NAMES}
    assert built == header_fields()


def test_a_native_field_without_a_python_attribute_fails():
    fields = header_fields()
    fields["AttentionStep"].append(("logit_bias", "double"))
    with pytest.raises(RuntimeError, match=r"AttentionStep\.logit_bias has no attribute 'logit_bias'"):
        step_binding.check_fields(fake_ext(fields))


def test_a_type_mismatch_fails():
    fields = header_fields()
    fields["AttentionStep"] = [(n, "int64_t" if n == "softcap" else t) for n, t in fields["AttentionStep"]]
    with pytest.raises(RuntimeError, match=r"AttentionStep\.softcap is int64_t .* but float"):
        step_binding.check_fields(fake_ext(fields))


def test_a_python_option_the_native_step_ignores_fails():
    """Dropping a field from the header (as if a new option were added only in Python) names the option."""
    fields = header_fields()
    fields["AttentionStep"] = [(n, t) for n, t in fields["AttentionStep"] if n != "window"]
    with pytest.raises(RuntimeError, match=r"Attention\.window reaches no native AttentionStep field"):
        step_binding.check_fields(fake_ext(fields))


@pytest.mark.skipif(ops.native() is None, reason="native extension not built")
def test_descriptors_are_filled_by_name_and_checked():
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(2 * 8, 16, generator=g), torch.randn(16, 8, generator=g)
    d = step_ops.native_step(steps.BoundMlp(steps.Mlp("gelu_tanh"), gate_up, None, down))
    assert d.activation == steps.ACTIVATIONS.index("gelu_tanh") and d.gate_up_bias is None
    assert torch.equal(d.gate_up, gate_up) and torch.equal(d.down, down)
    x = torch.randn(3, 16, generator=g)
    want = ops.gelu_tanh_mul_reference(x @ gate_up.T) @ down.T
    torch.testing.assert_close(ops.native().mlp_step(x, d, ops.isa_level(), 8), want, rtol=1e-5, atol=1e-5)
    norm = steps.BoundNorm(steps.Norm("n"), torch.ones(16), eps=0.0)        # the struct's own check
    with pytest.raises(RuntimeError, match="eps must be > 0"):
        step_ops.native_step(norm)


def test_an_options_field_the_step_lacks_or_types_otherwise_fails():
    fields = header_fields()
    fields["AttentionOptions"].append(("logit_bias", "double"))
    with pytest.raises(RuntimeError,
                       match=r"AttentionOptions\.logit_bias is double .* Attention\.logit_bias is missing"):
        step_binding.check_fields(fake_ext(fields))
    fields = header_fields()
    fields["AttentionOptions"] = [(n, "double" if n == "window" else t) for n, t in fields["AttentionOptions"]]
    with pytest.raises(RuntimeError, match=r"AttentionOptions\.window is double .* Attention\.window is int"):
        step_binding.check_fields(fake_ext(fields))


@pytest.mark.skipif(ops.native() is None, reason="native extension not built")
def test_the_attention_kernels_take_the_steps_options():
    """The op takes the layer's Attention step; its options reach the kernel as one struct, filled by name, and
    soft-capped scores and a window change the result as the float64 reference says (compute/reference.py)."""
    g = torch.Generator().manual_seed(3)
    heads, kvh, d, span = 4, 2, 16, 8
    k, v = torch.randn(6, span, kvh, d, generator=g), torch.randn(6, span, kvh, d, generator=g)
    spans, ctx = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]]), torch.tensor([29, 11])
    q = torch.randn(2, heads, d, generator=g) * 4
    opts = steps.Attention(0.5, softcap=2.0, window=5)
    assert ops.attention_options(0.5, 2.0, 5) is step_binding.options(opts, ops.native())   # one struct per step
    got = ops.decode_attention(q, k, v, spans, ctx, opts)
    want = ops.decode_attention_reference(q.double(), k.double(), v.double(), spans, ctx, opts)
    plain = ops.decode_attention_reference(q.double(), k.double(), v.double(), spans, ctx, steps.Attention(0.5))
    assert (got.double() - want).abs().max() < 1e-5 < (plain - want).abs().max()
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.decode_attention(q, k, v, spans, ctx, steps.Attention(0.5, window=-1))
