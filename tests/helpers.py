"""Small helpers shared by the tests: serialize a tiny model, start an Engine, collect a stream."""
from __future__ import annotations

import torch

from allspark_client import GenerateRequestStatus
from allspark_server import Engine, HuggingFaceModel, TargetDevice


def serialize(hf_dir: str, name: str, out_dir: str, dtype: str = "float32") -> HuggingFaceModel:
    loader = HuggingFaceModel(hf_dir, name, user_set_data_type=dtype)
    loader.load_model().serialize(None, model_output_dir=out_dir).free_model()
    return loader


def start_engine(loader: HuggingFaceModel, name: str, engine: Engine | None = None, max_batch: int = 8,
                 max_length: int = 1024, span_size: int = 16, kv_bytes: int = 0, prefill: int = 0) -> Engine:
    engine = engine or Engine()
    b = loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=max_batch)
    b.max_length(max_length).kv_cache_span_size(span_size).max_prefill_length(prefill)
    if kv_bytes:
        b.kv_cache_memory(kv_bytes)
    engine.install_model(b.build())
    engine.start_model(name)
    return engine


def collect(queue, timeout_s: float = 120.0):
    """Read a stream to its end: (token ids, list of GeneratedElements, final status)."""
    tokens, elements = [], []
    while True:
        el = queue.GetWithTimeout(int(timeout_s * 1000))
        if el is None:
            status = queue.GenerateStatus()
            if status.is_terminal:
                return tokens, elements, status
            raise TimeoutError(f"no output for {timeout_s}s (status {status.name})")
        tokens.extend(el.ids_from_generate)
        elements.append(el)


def generate(engine: Engine, name: str, ids, gen: dict):
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen)
    assert status == 0, engine.get_last_error()
    tokens, elements, final = collect(queue)
    assert final == GenerateRequestStatus.GenerateFinished, (final, queue.ErrorMessage())
    engine.release_request(name, handle)
    return tokens, elements


def greedy(engine: Engine, name: str, ids, max_new_tokens: int) -> list[int]:
    return generate(engine, name, ids, {"top_k": 1, "max_new_tokens": max_new_tokens,
                                              "eos_token_id": []})[0]


def hf_greedy(model, ids, max_new_tokens: int) -> list[int]:
    x = torch.tensor([list(ids)])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, x.shape[1]:].tolist()


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
