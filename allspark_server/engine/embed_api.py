"""Embeddings, Engine's side: `embed` (a mixin).

Each input runs as a request of its own through the scheduler (batched with generation, chunked, preempted like
any), marked `embedding`: its steps return its rows' final-norm hidden states instead of logits, nothing is sampled,
and it finishes once its input is computed; rank 0 pools the rows (runner/row_outputs.py). It takes no prefix-cache
hit (every row is computed), though the spans it fills are offered to the cache. Argument checks are the client's
(allspark_client/embed_args.py), so ClientEngine refuses the same things.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from allspark_client.embed_args import parse_embed_args
from allspark_client.generation_config import GenerationConfig
from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsException, AsStatus, GenerateRequestStatus, RequestHandle
from allspark_client.validation import ConfigError
from allspark_server.core.request import Request
from allspark_server.engine.commands import AddRequest
from allspark_server.engine.sleep import asleep_message
from allspark_server.engine.thread import ForModel
from allspark_server.runner.row_outputs import EmbedJob
from allspark_server.runner.sampler import SamplingState


class EmbedAPI:
    """Engine's embed (it provides _lock, _model, _engine, _requests, _ids and _live_request)."""

    def embed(self, model_name: str, input_ids_list: Any, pooling: str = "last",
              normalize: bool = False) -> list[np.ndarray]:
        """One float32 vector [hidden_size] per input (a list of token-id lists): the decoder's final-norm hidden
        state of the input's last token (pooling="last") or their mean over its tokens ("mean"), L2-normalized
        when `normalize`. Raises AsException (PARAM_ERROR for bad arguments, EXCEED_LIMIT_ERROR for an input
        longer than max_length, REQUEST_DENIED when the model is not started)."""
        try:
            model = self._model(model_name)
            inputs = parse_embed_args(input_ids_list, pooling, normalize, model.runner.args.vocab_size)
        except ConfigError as e:
            raise AsException(e.status, str(e)) from None
        except Exception as e:     # RequestError: not installed, shut down
            raise AsException(getattr(e, "status", AsStatus.ALLSPARK_PARAM_ERROR), str(e)) from None
        limit = min(model.cfg.engine_max_length, model.spans.num_spans * model.spans.span_size)
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                raise AsException(AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR,
                                  f"input_ids_list[{i}] has {len(ids)} tokens, more than this model takes ({limit})")
        jobs = []
        with self._lock:
            if not model.started or self._models.get(model_name) is not model:
                raise AsException(AsStatus.ALLSPARK_REQUEST_DENIED, f"model {model_name!r} is not started")
            if model.asleep:
                raise AsException(AsStatus.ALLSPARK_REQUEST_DENIED, asleep_message(model_name))
            gen = GenerationConfig(do_sample=False)
            for ids in inputs:
                rid = next(self._ids)
                queue = ResultQueue(context_length=len(ids))
                req = Request(rid, ids, len(ids) + 1, sampling=gen, embedding=True)
                job = EmbedJob(pooling, normalize, {})
                self._requests[model_name][rid] = self._live_request(RequestHandle(model_name, rid), queue)
                self._engine.post(ForModel(model_name, AddRequest(req, queue, SamplingState(gen), embed=job)))
                jobs.append((rid, queue, job))
        try:
            out = []
            for rid, queue, job in jobs:
                queue._wait_terminal()
                status = queue.GenerateStatus()
                if status != GenerateRequestStatus.GenerateFinished or job.result is None:
                    raise AsException(AsStatus.ALLSPARK_RUNTIME_ERROR,
                                      f"embedding failed ({status.name}): {queue.ErrorMessage()}")
                out.append(job.result.numpy().astype(np.float32, copy=False))
            return out
        finally:
            with self._lock:
                live = self._requests.get(model_name, {})
                for rid, _, _ in jobs:
                    live.pop(rid, None)
