"""Small helpers shared by the tests: serialize a tiny model, start an Engine, collect a stream, and the
transformers references (greedy generate, logits, step-by-step loops) the engines are checked against."""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from allspark_client import GenerateRequestStatus, ResultQueue
from allspark_server import Engine, HuggingFaceModel, TargetDevice

# Tests that act on a request while it still generates (stop it, kill a rank, kill its client) start one of
# LONG_RUN_TOKENS: ~7 s of tiny-model decoding on 2 cores, far beyond any stall of a loaded CI machine (a
# 400-token request, ~0.3 s, once finished before the test's next call). They end it themselves, so the length
# costs no time. The engine or pool must allow LONG_RUN_MAX_LENGTH.
LONG_RUN_TOKENS = 8000
LONG_RUN_MAX_LENGTH = 8192


def serialize(hf_dir: str, name: str, out_dir: str, dtype: str = "float32") -> HuggingFaceModel:
    loader = HuggingFaceModel(hf_dir, name, user_set_data_type=dtype)
    loader.load_model().serialize(None, model_output_dir=out_dir).free_model()
    return loader


def start_engine(loader: HuggingFaceModel, name: str, engine: Engine | None = None, max_batch: int = 8,
                 max_length: int = 1024, span_size: int = 16, kv_bytes: int = 0, prefill: int = 0,
                 prefix_cache: bool = True, host_tier_bytes: int = 0, speculative: tuple = ()) -> Engine:
    """`speculative`: (method, tokens, {options}) for speculative_decoding, or () for none."""
    engine = engine or Engine()
    b = loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=max_batch)
    b.max_length(max_length).kv_cache_span_size(span_size).max_prefill_length(prefill).prefill_cache(prefix_cache)
    if speculative:
        method, tokens, *options = speculative
        b.speculative_decoding(method, tokens, **(options[0] if options else {}))
    if kv_bytes:
        b.kv_cache_memory(kv_bytes)
    if host_tier_bytes:
        b.prefix_cache_host_memory(host_tier_bytes)
    engine.install_model(b.build())
    engine.start_model(name)
    return engine


@contextlib.contextmanager
def installed_on_pool(client, loader: HuggingFaceModel, name: str, max_length: int = 256, max_batch: int = 4):
    """The model installed and started on a 2-rank pool (the session's `pool` fixture), released afterwards."""
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=max_batch)
           .max_length(max_length).kv_cache_span_size(16).build())
    client.install_model(cfg)
    client.start_model(name)
    try:
        assert '"world_size": 2' in client.get_model_info(name)
        yield client
    finally:
        assert client.stop_model(name) == 0 and client.release_model(name) == 0


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


def run_together(engine: Engine, name: str, requests: list[tuple[list[int], dict]]) -> list[tuple[list[int], list]]:
    """Start every (input ids, generation config) at once, so that they share steps; collect each to its end:
    [(tokens, GeneratedElements)] in the same order."""
    started = []
    for ids, gen in requests:
        status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen)
        assert status == 0, engine.get_last_error()
        started.append((handle, queue))
    out = []
    for handle, queue in started:
        tokens, elements, final = collect(queue)
        assert final == GenerateRequestStatus.GenerateFinished, (final, queue.ErrorMessage())
        engine.release_request(name, handle)
        out.append((tokens, elements))
    return out


def greedy(engine: Engine, name: str, ids, max_new_tokens: int) -> list[int]:
    return generate(engine, name, ids, {"top_k": 1, "max_new_tokens": max_new_tokens,
                                              "eos_token_id": []})[0]


def hf_greedy(model, ids, max_new_tokens: int) -> list[int]:
    x = torch.tensor([list(ids)], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, x.shape[1]:].tolist()


def assert_same_tokens(got: list[int], want: list[int], what: str = "") -> None:
    """got == want, with a failure that says where they part and shows a few tokens around it: pytest's own diff
    of two long token lists is one line per token, and on CI (no truncation there) a few thousand such lines
    pushed the list of failed tests out of the log's tail."""
    if list(got) == list(want):
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo, hi = max(0, first - 4), first + 8
    raise AssertionError(f"{what + ': ' if what else ''}{len(got)} tokens vs {len(want)} expected, first "
                         f"difference at index {first}: got ...{list(got[lo:hi])}..., expected "
                         f"...{list(want[lo:hi])}... (from index {lo})")


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


_hf_cache: dict = {}


def hf_ref(model, ids, n: int) -> list[int]:
    """transformers greedy continuation, cached per (model, prompt, n): many tests share a reference."""
    key = (id(model), tuple(ids), n)
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(model, ids, n)
    return _hf_cache[key]


def hf_logits(model, ids) -> torch.Tensor:
    """The HF model's logits for every position of ids, in float64: [L, V]."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double()


def hf_loop(model, prompt, max_new: int, process, eos=(), dtype: torch.dtype = torch.float64) -> list[int]:
    """Greedy decoding with the HF model, full recompute each step; process(all_ids, out, logits[V]) -> logits.
    The last position's logits are cast to `dtype` before `process` sees them."""
    ids, out = list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].to(dtype)
        tok = int(torch.argmax(process(list(ids), list(out), logits)))
        ids.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


class RecordingQueue(ResultQueue):
    """A ResultQueue that records every status it goes through, in order (install it with monkeypatch
    in place of the engine's / client's ResultQueue)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.history = [self.GenerateStatus()]

    def _set_status_locked(self, status, now):
        super()._set_status_locked(status, now)
        if self.history[-1] != self._status:
            self.history.append(self._status)


def hf_apply(proc, all_ids: list[int], x: torch.Tensor) -> torch.Tensor:
    """Run one HF logits processor on a single row x [V] with history all_ids."""
    ids = torch.tensor([list(all_ids)], dtype=torch.long)
    return proc(ids, x[None].clone())[0]


def presence_frequency_ref(x: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI-style penalties over the output only, in float64: logit -= frequency*count + presence*(count>0)."""
    out = x.double().clone()
    for tok, count in Counter(output_ids).items():
        out[tok] -= frequency * count + presence
    return out
