"""An eager stand-in for the CUDA decode graphs (runner/cuda_graphs.py), so that overlapped scheduling runs on the CPU.

Same `sizes`, `fits_decode` rule and `run_decode(chunks, mirrors, device_ids)` contract; the step runs eagerly
through the runner's model. Used by tests/models/test_overlap.py and tests/mpi/overlap_pool.py.
"""
from __future__ import annotations

from allspark_server.runner.cuda_graphs import DecodeGraphs, batch_ladder
from allspark_server.step.inputs import build_forward_inputs


class EagerDecodeGraphs:
    """The decode graphs' interface, run eagerly on the CPU."""

    def __init__(self, runner, max_batch: int):
        self.runner, self.sizes = runner, batch_ladder(max_batch)
        self.device_steps = 0   # steps that took their ids from the previous step's samples
        # the real graphs' span tables are this wide: a position past max_length has no entry there
        self.max_spans = -(-runner.cfg.engine_max_length // runner.span_size)

    fits_decode = DecodeGraphs.fits_decode

    def run_decode(self, chunks, mirrors, device_ids=None):
        for c in chunks:
            assert mirrors[c.request_id].num_computed_tokens // self.runner.span_size < self.max_spans
        if device_ids is not None:
            self.device_steps += 1
            for c in chunks:   # the mirrors learn these tokens from the next plan: a placeholder, replaced below
                m = mirrors[c.request_id]
                assert len(m.token_ids) == m.num_computed_tokens, "a mirror out of step with its plans"
                m.token_ids.append(-1)
        inputs = build_forward_inputs(chunks, mirrors, self.runner.span_size)
        if device_ids is not None:
            for c in chunks:
                mirrors[c.request_id].token_ids.pop()
            inputs.input_ids = device_ids.clone()
        return self.runner.model(inputs, self.runner.kv)


def install_on_every_runner(max_batch: int) -> None:
    """Give every ModelRunner allocated from now on (this process) the eager graphs."""
    from allspark_server.runner.model_runner import ModelRunner
    allocate = ModelRunner.allocate_kv

    def allocate_with_graphs(self, num_spans, tier_slots=0):
        allocate(self, num_spans, tier_slots)
        self.graphs = EagerDecodeGraphs(self, max_batch)
    ModelRunner.allocate_kv = allocate_with_graphs
