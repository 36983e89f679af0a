"""Benchmarks of the serving features: the prefix cache and guided JSON output.

    python benchmarks/run.py --features [--quick] [--sections guided prefix pool mbu] [--json PATH]

Same model as run.py (Llama architecture, random bf16 weights, ~0.5 B parameters; --quick: the small one), one
process, every engine on the same cores:
- **shared 2048-token prefix**: a request with a 2048-token prefix and its own 32-token suffix, then a second one
  sharing the prefix with another suffix: TTFT of each (median over 3 prefixes) on an Engine with the prefix cache.
- **multi-turn chat**: a shared 1500-token system prompt, 8 conversations of 4 turns; every turn appends 100 user
  tokens to the conversation and the 32 answered tokens are part of the next turn's prompt. TTFT median / p99 and
  total time, with and without the prefix cache, run two ways: one request at a time (turn 1 of every conversation,
  then turn 2, ...) and the 8 conversations at once.
- **guided JSON**: TPOT of requests constrained by a JSON schema next to unconstrained ones, at batch 1 (rounds
  interleaved) and with 8 concurrent requests.
- **pool**: the shared-prefix TTFT and guided TPOT at batch 1 through a 2-rank pool (ClientEngine) on the same cores.
- **mbu**: the engine's live memory-bandwidth utilisation (`get_as_engine_stat`) next to this harness's own
  roofline ratio for the same batch-1 decode.
`--sections` runs some of them and keeps the other sections' results already in the --json file. `run.py --smoke`
runs every section on tiny sizes (SMOKE_SIZES).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import common
import workloads as W


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes (the defaults: the ones the module docstring names)."""
    prefix: int = 2048               # the shared prefix, and each request's own suffix
    suffix: int = 32
    system: int = 1500               # the chat: system prompt, turns of each conversation, user tokens a turn
    turns: int = 4
    conversations: int = 8
    turn_tokens: int = 100
    new_tokens: int = 32             # tokens answered a turn
    plain_tokens: int = 64           # unconstrained requests' tokens next to the guided ones (at most guided_tokens)
    guided_tokens: int = 256
    concurrent: int = 8              # the guided rows' concurrent requests
    repeats: int = 3                 # shared prefixes, and the pool's guided rounds
    mbu_tokens: int = 128            # the MBU section's decode, its runs and the pause after each (the stat's window)
    mbu_repeats: int = 3
    mbu_pause_s: float = 11.0
    max_length: int = 2304


FULL_SIZES = Sizes()
SMOKE_SIZES = Sizes(prefix=64, suffix=8, system=32, turns=2, conversations=2, turn_tokens=8, new_tokens=4,
                    plain_tokens=8, concurrent=2, repeats=1, mbu_tokens=48, mbu_repeats=1, mbu_pause_s=0.0,
                    max_length=512)


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
    stats = queue.RequestStatInfo()
    engine.release_request(name, handle)
    gaps = max(1, len(tokens) - 1)
    tpot = (last - first) / gaps
    if tpot <= 0 and len(tokens) > 1:
        # This thread was off the CPU while the request decoded and took every token in one element: the engine's
        # own arrival stamps (milliseconds) still tell the decode's length.
        tpot = (stats["last_token_time"] - stats["first_token_time"]) / 1000 / gaps
    return {"ttft": first - t0, "tpot": tpot, "tokens": tokens, "prefix_cache_len": cached}


def shared_prefix(engine, name: str, vocab: int, s: Sizes) -> dict:
    firsts, seconds, cached = [], [], []
    gen = dict(W.GREEDY, max_new_tokens=1)
    for r in range(s.repeats):
        prefix = W.prompt(s.prefix, 900 + r, vocab)
        a = _timed(engine, name, prefix + W.prompt(s.suffix, 910 + r, vocab), gen)
        b = _timed(engine, name, prefix + W.prompt(s.suffix, 920 + r, vocab), gen)
        firsts.append(a["ttft"])
        seconds.append(b["ttft"])
        cached.append(b["prefix_cache_len"])
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"first_ttft_s": first, "second_ttft_s": second, "speedup": first / second,
            "second_prefix_cache_len": cached}


def multi_turn(engine, name: str, vocab: int, concurrent: bool, s: Sizes) -> dict:
    """The chat workload: concurrent = the 8 conversations at once (each its 4 turns in order: TTFT then includes
    waiting for the other conversations' prefills in the same steps); otherwise one request at a time, turn 1 of
    every conversation, then turn 2 of every one, ... (TTFT is the request's own prefill)."""
    system = W.prompt(s.system, 1, vocab)
    histories: list[list[int]] = [[] for _ in range(s.conversations)]
    ttfts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def turn(c: int, t: int):
        histories[c] += W.prompt(s.turn_tokens, 1000 + 10 * c + t, vocab)
        r = _timed(engine, name, system + histories[c], dict(W.GREEDY, max_new_tokens=s.new_tokens))
        histories[c] += r["tokens"]
        with lock:
            ttfts.append(r["ttft"])

    def conversation(c: int):
        try:
            for t in range(s.turns):
                turn(c, t)
        except Exception as e:   # reported after the run
            errors.append(repr(e))

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(s.conversations)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        for t in range(s.turns):
            for c in range(s.conversations):
                turn(c, t)
    assert not errors, errors
    stat = engine.get_as_engine_stat(name)
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p99_s": _p99(ttfts),
            "total_s": time.perf_counter() - t0, "requests": len(ttfts),
            "prefix_cache_hit_rate": stat.prefix_cache_hit_rate}


def pool_section(loader, vocab: int, s: Sizes) -> dict:
    """The shared-prefix TTFT and guided TPOT at batch 1 through a 2-rank pool (ClientEngine) on the same cores."""
    from allspark_client import ClientEngine
    out = {}
    with ClientEngine(ranks=2) as client:
        install(client, loader, "pool", True, s)
        out["shared_prefix"] = shared_prefix(client, "pool", vocab, s)
        print(f"2-rank pool, shared {s.prefix}-token prefix: {out['shared_prefix']}", flush=True)
        tp = {True: [], False: []}
        for r in range(s.repeats):
            for guided in (True, False):
                tp[guided] += [x["tpot"] for x in _tpot_runs(client, "pool", vocab, guided, 1, 7000 + 100 * r, s)]
        g, p = statistics.median(tp[True]), statistics.median(tp[False])
        out["guided_c1"] = {"guided_tpot_ms": 1e3 * g, "plain_tpot_ms": 1e3 * p, "ratio": g / p}
        print(f"2-rank pool, guided JSON at batch 1: {out['guided_c1']}", flush=True)
        client.stop_model("pool")
        client.release_model("pool")
    return out


def install(engine, loader, name: str, prefix_cache: bool, s: Sizes, max_batch: int = 8) -> None:
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=max_batch)
           .max_length(s.max_length).kv_cache_span_size(32).prefill_cache(prefix_cache).build())
    engine.install_model(cfg)
    engine.start_model(name)


def prefix_cache_section(loader, vocab: int, s: Sizes) -> dict:
    """Each multi-turn variant on a fresh pair of engines (with and without the cache), uncached first."""
    from allspark_server import Engine
    engine = Engine()
    install(engine, loader, "prefix", True, s)
    out = {"shared_prefix": shared_prefix(engine, "prefix", vocab, s)}
    print(f"shared {s.prefix}-token prefix: {out['shared_prefix']}", flush=True)
    engine.stop_model("prefix")
    engine.release_model("prefix")
    for mode in ("one_at_a_time", "concurrent"):
        row = {}
        for cached in (False, True):
            install(engine, loader, "chat", cached, s)
            row["cached" if cached else "uncached"] = multi_turn(engine, "chat", vocab, mode == "concurrent", s)
            engine.stop_model("chat")
            engine.release_model("chat")
        row["ttft_median_speedup"] = row["uncached"]["ttft_median_s"] / row["cached"]["ttft_median_s"]
        row["total_speedup"] = row["uncached"]["total_s"] / row["cached"]["total_s"]
        out[f"multi_turn_{mode}"] = row
        print(f"multi-turn chat, {mode}: {row}", flush=True)
    engine.shutdown()
    return out


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["street", "zip"],
                                          "properties": {"street": {"type": "string", "maxLength": 20},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
GUIDED = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA}}}


def _tpot_runs(engine, name: str, vocab: int, guided: bool, num: int, seed: int, s: Sizes) -> list[dict]:
    gen = dict(W.GREEDY, max_new_tokens=s.guided_tokens if guided else s.plain_tokens, **(GUIDED if guided else {}))
    out: list = [None] * num

    def one(i):
        out[i] = _timed(engine, name, W.prompt(64, seed + i, vocab), gen)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def guided_section(loader, vocab: int, rounds: int, s: Sizes) -> dict:
    """TPOT with a JSON schema next to without, same engine, rounds interleaved (greedy both ways)."""
    import json

    from allspark_server import Engine
    engine = Engine()
    install(engine, loader, "json", True, s)
    out = {"schema": JSON_SCHEMA}
    for num in (1, s.concurrent):
        tp = {True: [], False: []}
        lengths = []
        for r in range(rounds):
            for guided in (True, False):
                runs = _tpot_runs(engine, "json", vocab, guided, num, 5000 + 100 * r, s)
                tp[guided] += [x["tpot"] for x in runs]
                if guided:
                    lengths += [len(x["tokens"]) for x in runs]
                    for x in runs:   # the benchmark's own sanity check: the output is the schema's JSON
                        json.loads(loader.get_tokenizer().decode(x["tokens"], skip_special_tokens=True))
        g, p = statistics.median(tp[True]), statistics.median(tp[False])
        out[f"c{num}"] = {"guided_tpot_ms": 1e3 * g, "plain_tpot_ms": 1e3 * p, "ratio": g / p,
                          "guided_tokens_median": statistics.median(lengths)}
        print(f"guided JSON, {num} at once: {out[f'c{num}']}", flush=True)
    engine.stop_model("json")
    engine.release_model("json")
    engine.shutdown()
    return out


def mbu_section(loader, vocab: int, s: Sizes) -> dict:
    """The engine's own memory-bandwidth utilisation (get_as_engine_stat) next to the benchmark's roofline ratio
    for the same batch-1 decode: tokens/s x bytes per token (from the model file's tensors, not the engine's count)
    / the copy bandwidth measured around the run."""
    import machine

    from allspark_server import Engine
    engine = Engine()
    install(engine, loader, "mbu", True, s)
    a = loader.args
    kv_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 2                      # bf16 K and V
    rows = []
    for r in range(s.mbu_repeats):
        bw_before = machine.copy_bandwidth()
        x = _timed(engine, "mbu", W.prompt(W.DECODE_PROMPT_LEN, 8000 + r, vocab),
                   dict(W.GREEDY, max_new_tokens=s.mbu_tokens))
        if x["tpot"] <= 0:
            raise RuntimeError(f"MBU run {r}: {len(x['tokens'])} tokens decoded within one millisecond; "
                               "raise mbu_tokens to time them")
        stat = engine.get_as_engine_stat("mbu")    # its window (10 s) holds this run's decode steps
        bw = (bw_before + machine.copy_bandwidth()) / 2
        ctx = W.DECODE_PROMPT_LEN + s.mbu_tokens / 2                                    # mean context
        per_token = common.file_bytes_per_token(loader.weights_path, int(ctx * kv_token))
        rows.append({"engine_mbu": stat.memory_bandwidth_utilization, "engine_bandwidth_gbs": stat.memory_bandwidth_gbs,
                     "benchmark_roofline_ratio": per_token / x["tpot"] / (bw * 1e9), "copy_gbs_around": bw})
        time.sleep(s.mbu_pause_s)                  # the next run's window starts empty
    engine.stop_model("mbu")
    engine.release_model("mbu")
    engine.shutdown()
    out = {"runs": rows, "engine_mbu_median": statistics.median(r["engine_mbu"] for r in rows),
           "benchmark_ratio_median": statistics.median(r["benchmark_roofline_ratio"] for r in rows)}
    out["engine_vs_benchmark"] = out["engine_mbu_median"] / out["benchmark_ratio_median"]
    print(f"MBU: {out}", flush=True)
    return out


SECTIONS = ("guided", "prefix", "pool", "mbu")


def main(spec: dict, save, sections=SECTIONS, report=None, sizes: Sizes = FULL_SIZES) -> dict:
    """The sections' report (`report`'s other sections kept); `save(report)` after each section."""
    import os

    from allspark_server import HuggingFaceModel
    from allspark_server.loader.tiny_model import build_tokenizer
    report = dict(report or {}, spec=spec)
    hf_dir = common.build_model(spec, "bfloat16")
    if not os.path.exists(os.path.join(hf_dir, "tokenizer.json")):   # guided output needs one (512 tokens)
        build_tokenizer(hf_dir)
    loader = HuggingFaceModel(hf_dir, "bench-features", user_set_data_type="bfloat16")
    import tempfile
    out_dir = tempfile.mkdtemp(prefix="allspark-features-")
    loader.load_model().serialize(None, model_output_dir=out_dir).free_model()
    if "guided" in sections:
        report["guided_json"] = guided_section(loader, spec["vocab"], min(3, spec["repeats"]), sizes)
        save(report)
    if "prefix" in sections:
        report["prefix_cache"] = prefix_cache_section(loader, spec["vocab"], sizes)
        save(report)
    if "pool" in sections:
        report["pool_2_ranks"] = pool_section(loader, spec["vocab"], sizes)
        save(report)
    if "mbu" in sections:
        report["mbu"] = mbu_section(loader, spec["vocab"], sizes)
        save(report)
    return report
