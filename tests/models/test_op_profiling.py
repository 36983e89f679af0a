"""Op profiling (issue 38 §4): get_op_profile / get_op_profiling_info of a model installed with profiling on
(enable_profiling, or AS_PROFILE=ON), on the Engine (native decode stack and Python layer loop), on a 2-rank pool's
ClientEngine (every rank's rows), and on a GPU. Counts are checked against the steps the requests must take (one
prefill step, then one decode step per further token); the ops' total against each rank's own step timer: never
more (no op counted twice), and most of it (what no op covers is Python between ops, and whatever preempts the
process there on a loaded machine: the bound is loose, the issue's 10% is measured, not asserted)."""
from __future__ import annotations

import pytest
import torch
from helpers import greedy, hf_greedy, random_prompt, serialize

from allspark_client import AsException, AsStatus, TargetDevice
from allspark_client.op_profile_report import STEP_ROW, UNTIMED_ROW
from allspark_server import Engine
from allspark_server.loader.tiny_model import build_tiny_model

LAYERS, PROMPT, NEW = 3, 12, 6          # one prefill step, then NEW - 1 decode steps
# a model whose kernels outweigh the Python between them, so the ops can cover the step
SIZE = dict(hidden_size=512, num_layers=LAYERS, intermediate_size=1536, vocab_size=2048)
UNTIMED_AT_MOST = 0.25                  # of the step time
COLUMNS = ["rank", "opname", "count", "min_ms", "max_ms", "ave_ms", "total_ms", "percentage"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf_dir = str(tmp_path_factory.mktemp("prof_hf"))
    hf = build_tiny_model(hf_dir, "llama_gqa_llama3", seed=3, **SIZE)
    return serialize(hf_dir, "prof", str(tmp_path_factory.mktemp("prof_as"))), hf


def _config(loader, name: str, profiling: bool, device=TargetDevice.CPU):
    b = (loader.create_reference_runtime_config_builder(name, device, [0], max_batch=2)
         .max_length(128).kv_cache_span_size(16))
    return (b.profiling() if profiling else b).build()


def _engine(loader, name: str, profiling: bool = True, device=TargetDevice.CPU) -> Engine:
    engine = Engine()
    engine.install_model(_config(loader, name, profiling, device))
    engine.start_model(name)
    return engine


def _ops(report, rank: int = 0) -> dict:
    return {o.op: o for o in report.ops if o.rank == rank}


def _assert_ops_cover_the_step(report, rank: int, steps: int) -> None:
    s = next(s for s in report.steps if s.rank == rank)
    assert s.steps == steps
    untimed = report.untimed_ms(rank)
    assert -0.01 * s.step_ms <= untimed <= UNTIMED_AT_MOST * s.step_ms, report.table()
    for o in report.ops:
        assert o.count > 0 and 0 <= o.min_ms <= o.ave_ms <= o.max_ms <= o.sum_ms, o


def _table_rows(table: str) -> list[list[str]]:
    lines = table.splitlines()
    assert lines[2].split() == COLUMNS, table
    return [line.split() for line in lines[4:] if line and not line.startswith("-")]


def test_off_has_no_rows_and_says_how_to_turn_it_on(model):
    loader, _ = model
    engine = _engine(loader, "off", profiling=False)
    try:
        report = engine.get_op_profile("off")
        assert not report.enabled and report.ops == () and report.steps == ()
        text = engine.get_op_profiling_info("off")
        assert "off" in text and "AS_PROFILE=ON" in text and "enable_profiling" in text
        with pytest.raises(AsException) as err:
            engine.get_op_profiling_info("nosuch")
        assert err.value.status == AsStatus.ALLSPARK_PARAM_ERROR and "nosuch" in str(err.value)
    finally:
        engine.shutdown()


def test_native_decode_stack_ops_cover_the_steps(model):
    loader, hf = model
    engine = _engine(loader, "on")
    try:
        prompt = random_prompt(PROMPT, seed=5, vocab=SIZE["vocab_size"])
        assert greedy(engine, "on", torch.tensor([prompt]), NEW) == hf_greedy(hf, prompt, NEW)   # unchanged output
        report = engine.get_op_profile("on")
        ops = _ops(report)
        decode = NEW - 1
        for op in ("qkv_proj", "kv_store", "attention", "o_proj", "gate_up_proj", "act_mul", "down_proj", "rotary"):
            assert ops[op].count == LAYERS * decode, (op, report.table())
        assert ops["norm"].count == 2 * LAYERS * NEW                  # two per layer, prefill and decode steps alike
        assert ops["prefill_attention"].count == ops["prefill_mlp"].count == LAYERS
        assert ops["lm_head"].count == NEW and ops["sample"].count == NEW
        assert ops["embedding"].count == ops["final_norm"].count == NEW
        assert "allreduce" not in ops            # one rank, no biases: the stack never calls back
        _assert_ops_cover_the_step(report, 0, NEW)
        rows = _table_rows(engine.get_op_profiling_info("on"))
        assert {r[1] for r in rows} == set(ops) | {UNTIMED_ROW, STEP_ROW}
        assert all(r[0] == "0" for r in rows)
        step_row = next(r for r in rows if r[1] == STEP_ROW)
        assert step_row[2] == str(NEW) and float(step_row[-1]) == pytest.approx(100.0)
    finally:
        engine.shutdown()


def test_python_layer_loop_times_each_step_and_its_allreduce(model):
    loader, hf = model
    engine = _engine(loader, "loop")
    try:
        engine._models["loop"].runner.model.decode_stack = lambda kv: None     # as where the native stack cannot run
        prompt = random_prompt(PROMPT, seed=6, vocab=SIZE["vocab_size"])
        assert greedy(engine, "loop", torch.tensor([prompt]), NEW) == hf_greedy(hf, prompt, NEW)
        report = engine.get_op_profile("loop")
        ops, decode = _ops(report), NEW - 1
        assert ops["attention_step"].count == ops["mlp_step"].count == LAYERS * decode
        # every sublayer's sum is timed: with the norm after it (that norm's own op), the last one alone
        assert ops["allreduce_norm"].count == (2 * LAYERS - 1) * decode
        assert ops["allreduce"].count == decode
        assert "qkv_proj" not in ops
        _assert_ops_cover_the_step(report, 0, NEW)
    finally:
        engine.shutdown()


def test_as_profile_turns_it_on_and_a_bad_value_is_refused(model, monkeypatch):
    loader, _ = model
    monkeypatch.delenv("ALLSPARK_PROFILE", raising=False)
    engine = Engine()
    try:
        monkeypatch.setenv("AS_PROFILE", "sometimes")
        with pytest.raises(AsException) as err:
            engine.install_model(_config(loader, "env", profiling=False))
        assert err.value.status == AsStatus.ALLSPARK_PARAM_ERROR and "AS_PROFILE='sometimes'" in str(err.value)
        monkeypatch.setenv("AS_PROFILE", "ON")
        engine.install_model(_config(loader, "env", profiling=False))
        engine.start_model("env")
        greedy(engine, "env", torch.tensor([random_prompt(PROMPT, seed=7)]), 2)
        report = engine.get_op_profile("env")
        assert report.enabled and _ops(report)["sample"].count == 2
    finally:
        engine.shutdown()


def test_a_pool_reports_every_ranks_rows(pool, model):
    client, _ = pool
    loader, hf = model
    assert "AS_PROFILE" in client.get_op_profiling_info("llama")      # the session's model: installed without
    client.install_model(_config(loader, "prof2", profiling=True))
    client.start_model("prof2")
    try:
        prompt = random_prompt(PROMPT, seed=8, vocab=SIZE["vocab_size"])
        assert greedy(client, "prof2", prompt, NEW) == hf_greedy(hf, prompt, NEW)
        report = client.get_op_profile("prof2")
        assert {s.rank for s in report.steps} == {0, 1}
        for rank in (0, 1):
            ops = _ops(report, rank)
            assert ops["qkv_proj"].count == LAYERS * (NEW - 1), report.table()
            assert ops["allreduce"].count == 2 * LAYERS * (NEW - 1)    # the row-parallel sums, called from the stack
            assert ("sample" in ops) == (rank == 0)                     # rank 0 samples
            _assert_ops_cover_the_step(report, rank, NEW)
        rows = _table_rows(client.get_op_profiling_info("prof2"))
        assert {r[0] for r in rows} == {"0", "1"}
    finally:
        client.stop_model("prof2")
        client.release_model("prof2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_ops_are_timed_with_cuda_events(model, graphs):
    from allspark_client import settings
    loader, hf = model
    with settings.override(CUDA_GRAPHS=graphs):
        engine = _engine(loader, "gpu", device=TargetDevice.CUDA)
    try:
        prompt = random_prompt(PROMPT, seed=9, vocab=SIZE["vocab_size"])
        assert greedy(engine, "gpu", torch.tensor([prompt]), NEW) == hf_greedy(hf, prompt, NEW)
        report = engine.get_op_profile("gpu")
        assert "CUDA events" in report.clock
        ops, decode = _ops(report), NEW - 1
        if graphs:
            assert ops["decode_graph"].count == decode and "attention_step" not in ops
        else:
            assert ops["attention_step"].count == ops["mlp_step"].count == LAYERS * decode
        assert ops["prefill_attention"].count == LAYERS
        _assert_ops_cover_the_step(report, 0, NEW)
    finally:
        engine.shutdown()
