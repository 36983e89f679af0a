"""Qwen2-VL serving: allspark's Engine against transformers in the same run, on the same prompts and images.

- Workload A (--requests single-image chats started together, default 32): each a short chat with one random-noise
  image of --image-size x --image-size pixels (a different seed per request and round), greedy with EOS ignored,
  --tokens new tokens each.
  * allspark: every request submitted from a thread of its own at once (start_request encodes the request's image
    in the calling thread; requests that start together share the vision tower's forwards). TTFT per request: from
    its start_request call to its first generated token (median and p90 over the requests). Throughput: all
    generated tokens / the time from before the first submission to the last token.
  * transformers: `generate` on the same prompts as one left-padded batch (the processor's output on the GPU).
    TTFT: the time of `generate(max_new_tokens=1)` on the batch (the vision tower, the batch's prefill and one
    token, every request's first token at that time). Throughput: requests x tokens / the time of the full
    `generate(max_new_tokens=tokens, min_new_tokens=tokens)`.
  * allspark_text_only (a diagnostic, not a comparison): the same token ids with the image tokens replaced by a
    text token and no pixels, so its TTFT is the same-length prefill without the vision tower.
  The images are preprocessed by the folder's transformers processor before the clocks start (for both engines).
- Workload B (multi-turn, one request at a time): turn 1 a chat with one image, run to --tokens tokens; turn 2 the
  turn-1 prompt + its generated ids + a new user question (ids concatenated as the chat template joins turns), with
  the same pixels. TTFT of turn 2 (a) after turn 1 of the same image (a prefix-cache hit: the turn-1 prompt's spans
  and the image's embeddings are reused) against (b) the same turn-2 ids with a fresh image of the same size (no
  hit); the engine's prefix_cache_hit_token delta of each is reported.
- Rounds: round 0 is a warm-up and is dropped; in the measured rounds allspark and transformers
  alternate which goes first; reported numbers are medians over rounds, ratios medians of the rounds' ratios.
- Also reported: our vision tower's forward alone (vision/encoder.py, built from the same folder) on one image and
  on 16 images, the median of 5 after a warm-up.

Models (random weights: outputs are meaningless, only the cost is measured):
- `--model 2b`: Qwen2-VL-2B's shapes (text: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960,
  vocab 151936, tied embeddings, mrope_section [16, 24, 24]; vision: depth 32, embed_dim 1280, 16 heads, mlp_ratio
  4, patch 14, merge 2), bf16, built on the device with transformers' config classes and saved with the tiny
  tokenizer, chat template and an image processor with Qwen2-VL's default pixel bounds (tests/vl_cases.py; the
  weights' vocab is larger than the tokenizer's, which only the ids care about).
- `--model tiny`: tests/vl_cases.build_vl_model's tiny folder (fp32): checks that the script runs.

    python benchmarks/vl.py --device cuda --model 2b --out              # the issue's benchmark on one GPU
    python benchmarks/vl.py --model tiny --rounds 1 --requests 4 --tokens 4   # checks that it runs (CPU)

--out alone writes benchmarks/results/vl-<model>-<machine>.json, --out PATH writes PATH; without --out no file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import machine_kind, machine_name, result_path, spin_openmp, write_report  # noqa: E402
from vl_inputs import build_2b, build_tiny, chat, engine_requests, processed  # noqa: E402

QUESTION = "What else is in the picture?"
TOWER_BATCH = 16


def gen_config(tokens: int) -> dict:
    return {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []}   # greedy, EOS ignored: exactly `tokens`


def run_one(engine, name: str, inputs: dict, tokens: int, timing: dict | None = None) -> tuple[float, list[int]]:
    """(seconds from start_request to the first generated token, the generated ids) of one request; `timing`
    gets "submit_s" (how long start_request took: with images, their encoding) and "first_token_at" (the clock)."""
    t0 = time.perf_counter()
    status, handle, queue = engine.start_request(name, inputs, gen_config(tokens))
    assert status == 0, engine.get_last_error()
    if timing is not None:
        timing["submit_s"] = time.perf_counter() - t0
    out, first = [], None
    while (el := queue.Get()) is not None:
        if el.ids_from_generate:
            first = first or time.perf_counter()
            out.extend(el.ids_from_generate)
    engine.release_request(name, handle)
    assert len(out) == tokens, (len(out), tokens)
    if timing is not None:
        timing["first_token_at"] = first
    return first - t0, out


def tower_forwards(engine, name: str):
    """How many forwards the served model's vision tower has run (a private counter, for the report's diagnostics;
    None where it cannot be read)."""
    try:
        return engine._model(name)._image_tower.batcher.forwards
    except Exception:
        return None


def allspark_burst(engine, name: str, requests: list[dict], tokens: int) -> dict:
    """All requests started together, one thread each: per-request TTFT and the total throughput."""
    n = len(requests)
    forwards = tower_forwards(engine, name)
    ttft, outs, errors, timings = [0.0] * n, [None] * n, [], [{} for _ in range(n)]
    go = threading.Barrier(n + 1)

    def one(i):
        try:
            go.wait()
            ttft[i], outs[i] = run_one(engine, name, requests[i], tokens, timings[i])
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    submit = sorted(t["submit_s"] for t in timings)
    return summary(ttft, n * tokens / elapsed, elapsed) | {
        "submit_median_s": statistics.median(submit), "submit_max_s": submit[-1],
        "first_token_first_s": min(t["first_token_at"] for t in timings) - t0,
        "tower_forwards": None if forwards is None else tower_forwards(engine, name) - forwards,
        "first_tokens": [o[0] for o in outs]}


def summary(ttft: list[float], tps: float, wall: float) -> dict:
    s = sorted(ttft)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return {"ttft_median_s": statistics.median(s), "ttft_p90_s": p90, "ttft_max_s": s[-1], "tokens_per_s": tps,
            "wall_s": wall}


def hf_batch(model, batch: dict, tokens: int, device: str) -> dict:
    """transformers' generate on the left-padded batch: TTFT = generate(max_new_tokens=1), throughput from the
    full generate."""
    import torch

    kw = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    n, prompt = kw["input_ids"].shape
    pad = model.config.text_config.pad_token_id if hasattr(model.config, "text_config") else 0

    def gen(new):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kw, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out
    first_s, out1 = gen(1)
    full_s, out = gen(tokens)
    assert out.shape[1] - prompt == tokens, (out.shape, prompt, tokens)
    return summary([first_s] * n, n * tokens / full_s, full_s) | {"first_tokens": out1[:, prompt].tolist()}


def text_only(requests: list[dict], image_token: int, filler: int) -> list[dict]:
    """The requests' ids with every image token replaced by `filler` (a text token; one per round, so that no
    round's prompts are in the prefix cache from an earlier round) and no pixels."""
    return [{"input_ids": [filler if t == image_token else t for t in r["input_ids"]]} for r in requests]


def turn2_ids(turn1: list[int], answer: list[int], tokenizer) -> list[int]:
    """The ids of turn 2: turn 1's prompt, its answer, the end of the assistant turn and a new user question."""
    tail = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    return turn1 + answer + tokenizer.encode("<|im_end|>\n" + tail, add_special_tokens=False)


def multi_turn(engine, name: str, processor, size: int, tokens: int, r: int, order: int) -> dict:
    from vl_cases import make_image

    def hits():
        return engine.get_as_engine_stat(name).prefix_cache_hit_token

    same, fresh = make_image(size, size, seed=900_000 + r), make_image(size, size, seed=800_000 + r)
    t1 = engine_requests(processed(processor, [same], [chat(0)]))[0]
    _, answer = run_one(engine, name, t1, tokens)
    ids = turn2_ids(t1["input_ids"], answer, processor.tokenizer)
    fresh_pixels = engine_requests(processed(processor, [fresh], [chat(0)]))[0]
    cases = {"hit": dict(t1, input_ids=ids), "miss": dict(fresh_pixels, input_ids=ids)}
    got = {}
    for v in (("hit", "miss") if order % 2 == 0 else ("miss", "hit")):
        before = hits()
        ttft, _ = run_one(engine, name, cases[v], tokens)
        got[v] = {"ttft_s": ttft, "prefix_cache_hit_tokens": hits() - before}
    got["turn2_prompt_len"], got["turn1_prompt_len"] = len(ids), len(t1["input_ids"])
    return got


def tower_times(folder: str, dtype: str, device: str, batch: dict) -> dict:
    """Our vision tower's forward alone: one image and TOWER_BATCH images (ms, median of 5 after a warm-up)."""
    import torch

    from allspark_server.vision.encoder import VisionEncoder
    enc = VisionEncoder.from_hf(folder, folder, dtype=dtype, device=torch.device(device))
    grid = batch["image_grid_thw"]
    per = int(grid[0].prod())
    out = {}
    for n in (1, min(TOWER_BATCH, len(grid))):
        pixels, g = batch["pixel_values"][:n * per], grid[:n]
        times = []
        for _ in range(6):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                enc(pixels, g)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"{n}_images_ms"] = 1000 * statistics.median(times[1:])
    del enc
    return out


def median_of(runs: list[dict], *path) -> float:
    def get(d):
        for p in path:
            d = d[p]
        return d
    return statistics.median(get(run) for run in runs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="2b", choices=["2b", "tiny"],
                   help="2b: a random Qwen2-VL-2B-shaped bf16 model; tiny: tests/vl_cases' tiny fp32 model")
    p.add_argument("--requests", type=int, default=32, help="concurrent single-image requests (workload A)")
    p.add_argument("--image-size", type=int, default=448, help="the images' width and height in pixels")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up round)")
    p.add_argument("--out", nargs="?", const="", default=None,
                   help="write the JSON report: to PATH, or alone to benchmarks/results/vl-<model>-<machine>.json")
    a = p.parse_args(argv)
    if min(a.requests, a.rounds) < 1 or a.tokens < 2 or a.image_size < 28:
        raise SystemExit("--requests and --rounds must be >= 1, --tokens >= 2, --image-size >= 28")
    if a.device == "cpu":
        spin_openmp()
    import torch
    from vl_cases import make_image

    from allspark_server import Engine, HuggingFaceModel
    dtype = "bfloat16" if a.model == "2b" else "float32"

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "hf")
        t0 = time.perf_counter()
        model, processor = (build_2b if a.model == "2b" else build_tiny)(folder, a.device)
        built_s = time.perf_counter() - t0
        loader = HuggingFaceModel(folder, "vl", user_set_data_type=dtype)
        loader.load_model().serialize(None, model_output_dir=os.path.join(tmp, "model")).free_model()
        print(f"model built in {built_s:.1f}s, serialized in {time.perf_counter() - t0 - built_s:.1f}s", flush=True)

        def batch_of(r: int) -> dict:
            images = [make_image(a.image_size, a.image_size, seed=10_000 * (r + 1) + i) for i in range(a.requests)]
            return processed(processor, images, [chat(i) for i in range(a.requests)])

        probe = batch_of(0)
        reqs = engine_requests(probe)
        prompt_lens = [len(r["input_ids"]) for r in reqs]
        image_tokens = int(probe["image_grid_thw"][0].prod()) // 4
        turn2_room = 2 * max(prompt_lens) + 2 * a.tokens + 64
        engine = Engine()
        b = (loader.create_reference_runtime_config_builder("vl", a.device, [0], max_batch=a.requests)
             .max_length(turn2_room).kv_cache_span_size(16).prefill_cache(True))
        if a.device == "cuda":
            b.kv_cache_memory(4 << 30)          # leaves the GPU to transformers' model and activations
        engine.install_model(b.build())
        engine.start_model("vl")
        image_token = model.config.image_token_id
        runs, agree = [], []
        try:
            for r in range(a.rounds + 1):                  # round 0: a warm-up of every path, dropped
                tokens = a.tokens
                batch = probe if r == 0 else batch_of(r)
                reqs = engine_requests(batch)
                got = {}
                for v in (("allspark", "transformers") if r % 2 else ("transformers", "allspark")):
                    got[v] = (allspark_burst(engine, "vl", reqs, tokens) if v == "allspark"
                              else hf_batch(model, batch, tokens, a.device))
                got["allspark_text_only"] = allspark_burst(engine, "vl", text_only(reqs, image_token, 50 + r),
                                                           tokens)
                got["multi_turn"] = multi_turn(engine, "vl", processor, a.image_size, tokens, r, r)
                same = sum(x == y for x, y in zip(got["allspark"].pop("first_tokens"),
                                                  got["transformers"].pop("first_tokens")))
                got["allspark_text_only"].pop("first_tokens")
                mt = got["multi_turn"]
                sub = got["allspark"]
                print(f"  allspark start_request (image encoding): median {sub['submit_median_s'] * 1e3:.0f} ms, "
                      f"last returned at {sub['submit_max_s'] * 1e3:.0f} ms; first token of all at "
                      f"{sub['first_token_first_s'] * 1e3:.0f} ms; {sub['tower_forwards']} tower forwards",
                      flush=True)
                print("warm-up" if r == 0 else f"round {r}",
                      *(f"{v}: TTFT median {got[v]['ttft_median_s'] * 1e3:.0f} ms p90 "
                        f"{got[v]['ttft_p90_s'] * 1e3:.0f} ms, {got[v]['tokens_per_s']:.0f} tok/s;"
                        for v in ("allspark", "transformers", "allspark_text_only")),
                      f"turn 2 TTFT hit {mt['hit']['ttft_s'] * 1e3:.0f} ms ({mt['hit']['prefix_cache_hit_tokens']} "
                      f"cached tokens), miss {mt['miss']['ttft_s'] * 1e3:.0f} ms "
                      f"({mt['miss']['prefix_cache_hit_tokens']}); first tokens equal {same}/{a.requests}",
                      flush=True)
                if r:
                    runs.append(got)
                    agree.append(same)
            tower = tower_times(folder, dtype, a.device, probe)
            print("our vision tower alone:", {k: round(v, 1) for k, v in tower.items()}, flush=True)
        finally:
            engine.close()

    def ratio(run, num, den, key):
        return run[num][key] / run[den][key]
    workload_a = {
        v: {k: median_of(runs, v, k) for k in runs[0][v] if k.endswith("_s") or k == "tokens_per_s"}
        for v in ("allspark", "transformers", "allspark_text_only")}
    workload_a["transformers_ttft_over_allspark_median"] = statistics.median(
        ratio(run, "transformers", "allspark", "ttft_median_s") for run in runs)
    workload_a["transformers_ttft_over_allspark_p90"] = statistics.median(
        ratio(run, "transformers", "allspark", "ttft_p90_s") for run in runs)
    workload_a["allspark_tps_over_transformers"] = statistics.median(
        ratio(run, "allspark", "transformers", "tokens_per_s") for run in runs)
    workload_a["first_tokens_equal"] = agree
    workload_a["by_round"] = [{v: run[v] for v in ("allspark", "transformers", "allspark_text_only")}
                              for run in runs]
    mts = [run["multi_turn"] for run in runs]
    workload_b = {"turn2_ttft_hit_s": median_of(mts, "hit", "ttft_s"),
                  "turn2_ttft_miss_s": median_of(mts, "miss", "ttft_s"),
                  "miss_over_hit": statistics.median(m["miss"]["ttft_s"] / m["hit"]["ttft_s"] for m in mts),
                  "hit_prefix_cache_tokens": median_of(mts, "hit", "prefix_cache_hit_tokens"),
                  "miss_prefix_cache_tokens": median_of(mts, "miss", "prefix_cache_hit_tokens"),
                  "turn1_prompt_len": mts[0]["turn1_prompt_len"], "turn2_prompt_len": mts[0]["turn2_prompt_len"],
                  "by_round": mts}
    report = {
        "measure": "vl", "machine": machine_name() if a.device == "cpu" else torch.cuda.get_device_name(0),
        "kind": machine_kind(a.device), "device": a.device, "model": a.model, "dtype": dtype,
        "weights": "random", "requests": a.requests, "image_size": a.image_size, "image_tokens": image_tokens,
        "prompt_len": {"min": min(prompt_lens), "max": max(prompt_lens)}, "tokens": a.tokens, "rounds": a.rounds,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "measured": {
            "allspark": "Engine, every request submitted at once from its own thread: TTFT per request = its "
                        "start_request call (image encoding included) to its first generated token; tokens_per_s = "
                        "requests x tokens / (first submission to the last token); submit_*: how long "
                        "start_request took (it returns once the request's image is encoded); first_token_first_s: "
                        "the burst's start to the earliest first token",
            "transformers": "generate on the same prompts as one left-padded batch: TTFT = the time of "
                            "generate(max_new_tokens=1) on the batch (the same for every request); tokens_per_s = "
                            "requests x tokens / the time of generate(max_new_tokens=tokens, min_new_tokens=tokens)",
            "allspark_text_only": "the same ids with image tokens replaced by a text token and no pixels (prefill "
                                  "without the vision tower)",
            "multi_turn": "one request at a time: turn-2 TTFT after turn 1 of the same image (hit) vs the same ids "
                          "with a fresh image (miss); prefix_cache_hit_tokens = the engine stat's delta",
            "vision_tower": "our VisionEncoder's forward alone on 1 and 16 images of the workload's size",
            "preprocessing": "the transformers processor's output, made before the clocks start"},
        "concurrent": workload_a, "multi_turn": workload_b, "vision_tower": tower,
        "measured_at": time.strftime("%Y-%m-%d")}
    ttft_x = workload_a["transformers_ttft_over_allspark_median"]
    print(f"{a.requests} concurrent {a.image_size}px single-image requests, {a.tokens} tokens: TTFT median "
          f"allspark {workload_a['allspark']['ttft_median_s'] * 1e3:.0f} ms, transformers "
          f"{workload_a['transformers']['ttft_median_s'] * 1e3:.0f} ms (x{ttft_x:.2f}); "
          f"throughput allspark {workload_a['allspark']['tokens_per_s']:.0f} tok/s, transformers "
          f"{workload_a['transformers']['tokens_per_s']:.0f} (x{workload_a['allspark_tps_over_transformers']:.2f}); "
          f"turn-2 TTFT hit {workload_b['turn2_ttft_hit_s'] * 1e3:.0f} ms vs miss "
          f"{workload_b['turn2_ttft_miss_s'] * 1e3:.0f} ms (x{workload_b['miss_over_hit']:.2f})", flush=True)
    if a.out is not None:
        path = a.out or result_path(f"vl-{a.model}", a.device)
        write_report(path, report)
        print("wrote", path)


if __name__ == "__main__":
    main()
