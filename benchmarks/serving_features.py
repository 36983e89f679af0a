"""Benchmarks of the serving features (issue 11): the prefix cache and guided JSON output.

    python benchmarks/run.py --features [--quick] [--json benchmarks/results-features.json]

Same model as run.py (Llama architecture, random bf16 weights, ~0.5 B parameters; --quick: the small one), one
process, every engine on the same cores:
- **shared 2048-token prefix**: a request with a 2048-token prefix and its own 32-token suffix, then a second one
  sharing the prefix with another suffix: TTFT of each (median over 3 prefixes) on an Engine with the prefix cache.
- **multi-turn chat**: a shared 1500-token system prompt, 8 conversations running at once, 4 turns each; every turn
  appends ~100 user tokens to the conversation and the 32 answered tokens are part of the next turn's prompt.
  TTFT median / p99 and total time, with and without the prefix cache (two Engines, run one after the other).
- **guided JSON**: TPOT of requests constrained by a JSON schema next to unconstrained ones, at batch 1 (rounds
  interleaved) and with 8 concurrent requests.
"""
from __future__ import annotations

import statistics
import threading
import time

import workloads as W

NEW_TOKENS = 32
SYSTEM_TOKENS = 1500
TURNS, CONVERSATIONS, TURN_TOKENS = 4, 8, 100
PREFIX_TOKENS, SUFFIX_TOKENS = 2048, 32
MAX_LENGTH = 2304


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def _timed(engine, name: str, ids: list[int], gen: dict) -> dict:
    """One request: TTFT, TPOT, tokens, prefix_cache_len."""
    t0 = time.perf_counter()
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen)
    assert status == 0, engine.get_last_error()
    first = last = None
    tokens, cached = [], 0
    while (el := queue.Get()) is not None:
        now = time.perf_counter()
        if el.ids_from_generate:
            first = first or now
            last = now
            tokens.extend(el.ids_from_generate)
            cached = max(cached, el.prefix_cache_len)
    engine.release_request(name, handle)
    return {"ttft": first - t0, "tpot": (last - first) / max(1, len(tokens) - 1), "tokens": tokens,
            "prefix_cache_len": cached}


def shared_prefix(engine, name: str, vocab: int, repeats: int = 3) -> dict:
    firsts, seconds, cached = [], [], []
    gen = dict(W.GREEDY, max_new_tokens=1)
    for r in range(repeats):
        prefix = W.prompt(PREFIX_TOKENS, 900 + r, vocab)
        a = _timed(engine, name, prefix + W.prompt(SUFFIX_TOKENS, 910 + r, vocab), gen)
        b = _timed(engine, name, prefix + W.prompt(SUFFIX_TOKENS, 920 + r, vocab), gen)
        firsts.append(a["ttft"])
        seconds.append(b["ttft"])
        cached.append(b["prefix_cache_len"])
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"first_ttft_s": first, "second_ttft_s": second, "speedup": first / second,
            "second_prefix_cache_len": cached}


def multi_turn(engine, name: str, vocab: int) -> dict:
    system = W.prompt(SYSTEM_TOKENS, 1, vocab)
    ttfts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def conversation(c: int):
        history: list[int] = []
        try:
            for t in range(TURNS):
                history += W.prompt(TURN_TOKENS, 1000 + 10 * c + t, vocab)
                r = _timed(engine, name, system + history, dict(W.GREEDY, max_new_tokens=NEW_TOKENS))
                history += r["tokens"]
                with lock:
                    ttfts.append(r["ttft"])
        except Exception as e:   # reported after the run
            errors.append(repr(e))

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(CONVERSATIONS)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    stat = engine.get_as_engine_stat(name)
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p99_s": _p99(ttfts),
            "total_s": time.perf_counter() - t0, "requests": len(ttfts),
            "prefix_cache_hit_rate": stat.prefix_cache_hit_rate}


def install(engine, loader, name: str, prefix_cache: bool, max_batch: int = 8) -> None:
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=max_batch)
           .max_length(MAX_LENGTH).kv_cache_span_size(32).prefill_cache(prefix_cache).build())
    engine.install_model(cfg)
    engine.start_model(name)


def prefix_cache_section(loader, vocab: int) -> dict:
    from allspark_server import Engine
    engine = Engine()
    install(engine, loader, "cached", True)
    install(engine, loader, "uncached", False)
    out = {"shared_prefix": shared_prefix(engine, "cached", vocab)}
    print(f"shared {PREFIX_TOKENS}-token prefix: {out['shared_prefix']}", flush=True)
    out["multi_turn_uncached"] = multi_turn(engine, "uncached", vocab)
    print(f"multi-turn without the cache: {out['multi_turn_uncached']}", flush=True)
    out["multi_turn_cached"] = multi_turn(engine, "cached", vocab)
    print(f"multi-turn with the cache: {out['multi_turn_cached']}", flush=True)
    out["multi_turn_ttft_speedup"] = (out["multi_turn_uncached"]["ttft_median_s"]
                                      / out["multi_turn_cached"]["ttft_median_s"])
    out["multi_turn_total_speedup"] = out["multi_turn_uncached"]["total_s"] / out["multi_turn_cached"]["total_s"]
    for name in ("cached", "uncached"):
        engine.stop_model(name)
        engine.release_model(name)
    return out


def main(spec: dict, build_model, save) -> dict:
    from allspark_server import HuggingFaceModel
    report = {"spec": spec}
    hf_dir = build_model(spec, "bfloat16")
    loader = HuggingFaceModel(hf_dir, "bench-features", user_set_data_type="bfloat16")
    import tempfile
    out_dir = tempfile.mkdtemp(prefix="allspark-features-")
    loader.load_model().serialize(None, model_output_dir=out_dir).free_model()
    report["prefix_cache"] = prefix_cache_section(loader, spec["vocab"])
    save(report)
    return report
