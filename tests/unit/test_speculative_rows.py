"""How a speculating GPU model computes its verify rows (runner/model_runner.py): the speculative_rows option, its
"auto" rule by hidden size and verify rows, its validation, and its way through the pool's wire (absent: "auto")."""
from __future__ import annotations

import pytest

from allspark_client import wire
from allspark_client.config import AsModelConfig, AsModelRuntimeConfigBuilder, ConfigError
from allspark_server.runner.model_runner import speculates_in_invariant_rows


def config(method: str = "ngram", tokens: int = 4, rows: str = "auto") -> AsModelConfig:
    b = AsModelRuntimeConfigBuilder().model_name("m").model_file_path("/g.asgraph", "/g.asparam")
    if method:
        b.speculative_decoding(method, tokens, speculative_rows=rows)
    return b.build()


@pytest.mark.parametrize("hidden, tokens, rows, want", [
    (576, 4, "auto", False),        # SmolLM2, 5 verify rows: alone
    (576, 7, "auto", False),        # 8 rows
    (576, 8, "auto", True),         # 9 rows
    (2048, 4, "auto", True),        # a 2B-wide model and wider
    (4096, 1, "auto", True),
    (4096, 8, "alone", False),      # the option over the rule, both ways
    (576, 2, "invariant", True),
])
def test_rule(hidden, tokens, rows, want):
    assert speculates_in_invariant_rows(config(tokens=tokens, rows=rows), hidden) is want


def test_no_speculation_never_takes_them():
    assert speculates_in_invariant_rows(config(method=""), 8192) is False


def test_bad_value_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"speculative_rows must be one of \('auto', 'alone', 'invariant'\)"):
        config(rows="fast")


def test_through_the_wire():
    cfg = config(tokens=8, rows="invariant")
    assert wire.runtime_config_from_proto(wire.runtime_config_to_proto(cfg)).speculative_rows == "invariant"
    msg = wire.runtime_config_to_proto(cfg)
    msg.ClearField("speculative_rows")             # a client that predates the field
    assert wire.runtime_config_from_proto(msg).speculative_rows == "auto"
