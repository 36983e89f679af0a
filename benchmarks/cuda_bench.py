"""The GPU benchmark (`python benchmarks/run.py --device cuda`): allspark's Engine on one GPU against the
plain-PyTorch CUDA-graph decode step (torch_cuda_peer.py) on the same random Llama-2-7B-shaped bf16 weights.

Measures the device's copy bandwidth (device-to-device, bytes read + written) for the roofline, checks the
peer and the Engine against transformers, then batch-1 decode of both interleaved round by round. --quick
shrinks the model to 8 layers so that one device call holds everything. Writes JSON.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time

import torch

import torch_cuda_peer as peer_mod
from step_profile import StepProfile
from allspark_client import settings
from allspark_server.runner.memory_bandwidth import gpu_copy_bandwidth_gbs
import workloads as W

# what a run measures after the batch-1 rows (`run.py --device cuda --sections ...`; --quant adds its rows)
SECTIONS = ("ttft", "pool", "concurrency", "poisson")
# the batch-1 rounds' A/B graph variants: name -> the switch set to 0 when they are captured
GRAPH_VARIANTS = {"cublas": settings.TRITON_GEMV, "no_pdl": settings.PDL, "unfused_decode": settings.FUSED_DECODE}
LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)


def copy_bandwidth_gbs(nbytes: int = 2 << 30, repeats: int = 20) -> float:
    return gpu_copy_bandwidth_gbs(torch.device("cuda"), nbytes, repeats)


def graph_replay_ms(graphs, batch: int, repeats: int = 50) -> float:
    """GPU time of one replay of the Engine's decode graph for `batch` rows (diagnostic: the step's time on
    the GPU alone, without the host's scheduling, sampling and copies; replays the last step's inputs)."""
    g = graphs.graphs[batch]
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def bench_root(layers: int) -> str:
    """Where the benchmark's HF folder and its serialized model (as/) live."""
    return os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench-cuda", f"llama2-7b-{layers}l")


def serialized_bench_model(root: str):
    """The HF folder at `root` serialized as model 'bench-cuda' into root/as (once): its loader."""
    from allspark_server import HuggingFaceModel
    loader = HuggingFaceModel(root, "bench-cuda", user_set_data_type="bfloat16")
    loader.load_model().serialize_to_path(None, os.path.join(root, "as"), skip_if_exists=True).free_model()
    return loader


def kv_bytes_per_token(layers: int) -> int:
    return 2 * layers * LLAMA2_7B["hidden_size"] * 2      # bf16 K and V of every layer


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    """The first position where two greedy continuations differ (their length if nowhere)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def build_model(out_dir: str, layers: int) -> None:
    """A random bf16 Llama-2-7B-shaped HF folder (weights N(0, 0.02), initialized on the GPU for speed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return
    cfg = LlamaConfig(**dict(LLAMA2_7B, num_hidden_layers=layers), max_position_embeddings=4096,
                      torch_dtype="bfloat16", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()


def main(args, save=lambda report: None) -> dict:
    """The report; `save(report)` is called after each section, so a failure later keeps what was measured."""
    from transformers import AutoModelForCausalLM
    from allspark_server import Engine
    layers = 8 if args.quick else LLAMA2_7B["num_hidden_layers"]
    new_tokens, prompt_len, rounds = (64, 32, 3) if args.quick else (128, 32, 5)
    # 256 concurrent (with the peer's static cache and transformers beside) needs an H200's memory
    big = torch.cuda.get_device_properties(0).total_memory > 120e9
    concurrency = (16,) if args.quick else (16, 64, 128, 256) if big else (16, 64, 128)
    root = bench_root(layers)
    t0 = time.perf_counter()
    build_model(root, layers)
    report = {"device": torch.cuda.get_device_name(), "layers": layers, "copy_gbs": copy_bandwidth_gbs()}
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16).to("cuda").eval()
    nbytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    report["weight_bytes_per_token"] = nbytes
    report["roofline_tps"] = report["copy_gbs"] * 1e9 / nbytes
    prompt = W.prompt(prompt_len, 0, LLAMA2_7B["vocab_size"])
    report["peer_vs_hf_rel_err"] = peer_mod.check_against_hf(hf, prompt)
    report["memory_gb"] = MEMORY_GB
    note_memory("hf")
    weights = peer_mod.StaticWeights(hf)
    peer = peer_mod.StaticLlama(weights, batch=1, max_len=prompt_len + new_tokens + 8)
    peer.prefill_by_decoding(prompt)
    peer.capture()

    loader = serialized_bench_model(root)
    engine = Engine()
    ttft_lens = (128, 512) if args.quick else (128, 512, 2048)
    max_len = max(max(prompt_len, CONC_PROMPT) + max(new_tokens, CONC_NEW), max(ttft_lens)) + 16
    max_batch = max(concurrency)
    kv_tokens = max(max_batch * (CONC_PROMPT + CONC_NEW + 32), max_len + 32)
    kv_bytes = kv_tokens * kv_bytes_per_token(layers)                      # just enough
    cfg = (loader.create_reference_runtime_config_builder("bench-cuda", "cuda", [0], max_batch=max_batch)
           .max_length(max_len).kv_cache_span_size(32).kv_cache_memory(kv_bytes).build())
    engine.install_model(cfg)
    engine.start_model("bench-cuda")
    note_memory("hf+peer+engine")
    report["setup_s"] = time.perf_counter() - t0

    # our greedy tokens against transformers' (both bf16; a random model's near-ties can split them)
    ours = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    theirs = out[0, prompt_len:].tolist()
    report["greedy_ours_hf"] = [ours, theirs]
    report["greedy_first_divergence"] = first_divergence(ours, theirs)

    runs = {"allspark": [], "torch_cuda_graph": [], "allspark_no_overlap": []}
    served = engine._engine.models["bench-cuda"]
    # A/B: the same engine's decode graphs captured again with every dense linear on cuBLAS, without
    # programmatic dependent launch (cuda/pdl.py), and with rotary, attention and split combine as three
    # launches (decode_attention.fused_decode_enabled); swapped in as runner.graphs between requests
    ours_graphs = served.runner.graphs
    variants = {name: recaptured_graphs(served.runner, {var: False}) for name, var in GRAPH_VARIANTS.items()}
    runs.update({f"allspark_{name}": [] for name in variants})
    W.decode_tps(engine, "bench-cuda", LLAMA2_7B["vocab_size"], 8)

    def ours(seed):
        return W.decode_tps(engine, "bench-cuda", LLAMA2_7B["vocab_size"], new_tokens, seed=seed,
                            prompt_len=prompt_len)
    for r in range(rounds):
        runs["allspark"].append(ours(r))
        runs["torch_cuda_graph"].append(peer.decode_tps(prompt_len, new_tokens))
        with overlap_off(served):   # the same engine stepping one step at a time (ALLSPARK_OVERLAP=0)
            runs["allspark_no_overlap"].append(ours(r))
        for name, graphs in variants.items():
            served.runner.graphs = graphs
            runs[f"allspark_{name}"].append(ours(r))
        served.runner.graphs = ours_graphs
    overlap = runs.pop("allspark_no_overlap")
    others = {name: runs.pop(f"allspark_{name}") for name in variants}
    for name, tps in others.items():
        report[f"allspark_vs_{name}_b1"] = statistics.median(a / b for a, b in zip(runs["allspark"], tps))
        report[f"allspark_{name}_decode_b1_tps"] = statistics.median(tps)
        report[f"graph_replay_ms_b1_{name}"] = graph_replay_ms(variants[name], 1)
    del variants
    for name, tps in runs.items():
        report[f"{name}_decode_b1_tps"] = statistics.median(tps)
        report[f"{name}_decode_b1_roofline"] = statistics.median(tps) / report["roofline_tps"]
    report["decode_b1_tps_by_round"] = dict(runs, allspark_no_overlap=overlap,
                                            **{f"allspark_{n}": t for n, t in others.items()})
    report["allspark_vs_torch_cuda_graph"] = statistics.median(a / b for a, b in zip(*runs.values()))
    report["overlap_vs_no_overlap_b1"] = statistics.median(a / b for a, b in zip(runs["allspark"], overlap))
    report["graph_replay_ms_b1"] = graph_replay_ms(served.runner.graphs, 1)
    report["host_overhead_ms_b1"] = 1e3 / report["allspark_decode_b1_tps"] - report["graph_replay_ms_b1"]
    report["kernels_b1"] = kernel_breakdown(served.runner, 1, top=16)
    del peer
    free_memory()
    note_memory("after batch 1")
    save(report)
    sections = set(getattr(args, "sections", None) or SECTIONS)
    # the pools first: the quantized models leave cached GPU memory behind that a pool's rank 0 would need
    if torch.cuda.device_count() >= 2 and not args.no_pool and "pool" in sections:
        report["pool2"] = two_gpu_pool_rows(engine, loader, prompt_len, new_tokens, rounds)
        print(f"2-GPU pool: {report['pool2']}", flush=True)
        save(report)
    if "ttft" in sections:
        report["ttft"] = ttft_rows(engine, hf, ttft_lens)
        print(f"TTFT: {report['ttft']}", flush=True)
        save(report)
    if getattr(args, "quant", None):
        report["quant"] = quant_rows(engine, root, args.quant, prompt_len, new_tokens, rounds, max_len, layers)
        print(f"quantized weights: {report['quant']}", flush=True)
        save(report)
    for c in concurrency if "concurrency" in sections else ():
        report[f"c{c}"] = concurrent_rows(engine, hf, weights, c)
        print(f"concurrency {c}: {report[f'c{c}']}", flush=True)
        save(report)
    if "poisson" in sections:
        report["poisson"] = poisson_row(engine, 32 if args.quick else 128)
        print(f"Poisson arrivals: {report['poisson']}", flush=True)
    engine.stop_model("bench-cuda")
    engine.release_model("bench-cuda")
    return report


def ttft_rows(engine, hf, lengths, repeats: int = 3) -> dict:
    """Time to the first token of a lone prompt of each length: the Engine (W.ttft) and transformers' generate
    of one token (synchronized), medians of `repeats`."""
    vocab = LLAMA2_7B["vocab_size"]
    out = {}
    for n in lengths:
        W.first_token_s(engine, "bench-cuda", W.ttft_prompt(n, 0, vocab, salt=2))   # warm-up (not a cached prefix)
        ours = W.ttft(engine, "bench-cuda", vocab, n, repeats)
        times = [hf_generate_s(hf, [W.prompt(n, 100 + r, vocab)], 1) for r in range(repeats + 1)]
        theirs = statistics.median(times[1:])                                    # the first warms up
        out[n] = {"allspark_s": ours, "hf_s": theirs, "hf_vs_allspark": theirs / ours}
    return out


def hf_generate_s(hf, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds of one greedy transformers `generate` of exactly `new_tokens` for same-length prompts (a static
    batch), synchronized with the GPU on both sides."""
    ids = torch.tensor(batch, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def poisson_row(engine, num: int, rate: float = 16.0) -> dict:
    """`num` requests (128 in / 128 out) arriving as a Poisson process of `rate`/s: TTFT and TPOT median and p99,
    output tokens/s (workloads.poisson)."""
    return dict(W.poisson(engine, "bench-cuda", LLAMA2_7B["vocab_size"], num, rate, CONC_PROMPT, CONC_NEW),
                rate_rps=rate, requests=num)


CONC_PROMPT, CONC_NEW = 128, 128   # the concurrent rows: 128 tokens in, 128 out


def quant_rows(engine, root: str, variants: list[str], prompt_len: int, new_tokens: int, rounds: int,
               max_len: int, layers: int) -> dict:
    """The same weights quantized with InstantQuant (int8 per channel, int4_g128, ...) served by the same Engine
    next to the bf16 model, one variant at a time (two beside transformers, the bf16 model and its KV cache do
    not fit an H100): batch-1 decode interleaved round by round with bf16's, each with its weight bytes per
    token; greedy agreement with bf16 over 16 tokens."""
    from allspark_server import HuggingFaceModel
    from allspark_server.runner.memory_bandwidth import decode_weight_bytes
    from run import quant_variant
    vocab = LLAMA2_7B["vocab_size"]
    prompt = W.prompt(prompt_len, 0, vocab)
    bf16 = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
    out, by_round = {}, {}
    for v in variants:
        name = f"bench-cuda-{v}"
        q = HuggingFaceModel(root, name, user_set_data_type="bfloat16")
        t = time.perf_counter()
        q.load_model().serialize_to_path(None, os.path.join(root, f"as-{v}"), enable_quant=True, skip_if_exists=True,
                                         customized_quant_config=quant_variant(v)).free_model()
        kv_bytes = 8 * -(-max_len // 32) * 32 * kv_bytes_per_token(layers)    # 8 sequences
        builder = q.create_reference_runtime_config_builder(name, "cuda", [0], max_batch=8).max_length(max_len)
        builder = builder.kv_cache_span_size(32).kv_cache_memory(kv_bytes)
        engine.install_model(builder.build())
        engine.start_model(name)
        runner = engine._engine.models[name].runner
        out[v] = {"serialize_s": time.perf_counter() - t,
                  "weight_bytes_per_token": decode_weight_bytes(runner.model, runner.model.model.embed_tokens.weight),
                  "greedy_first_divergence_vs_bf16": first_divergence(bf16, W.greedy_tokens(engine, name, prompt, 16))}
        W.decode_tps(engine, name, vocab, 8)
        runs = by_round[v] = {"bfloat16": [], v: []}
        for r in range(rounds):
            for model, tps in (("bench-cuda", runs["bfloat16"]), (name, runs[v])):
                tps.append(W.decode_tps(engine, model, vocab, new_tokens, seed=r, prompt_len=prompt_len))
        out[v]["decode_b1_tps"] = statistics.median(runs[v])
        out[v]["vs_bf16"] = statistics.median(a / b for a, b in zip(runs[v], runs["bfloat16"]))
        out[v]["graph_replay_ms_b1"] = graph_replay_ms(runner.graphs, 1)
        engine.stop_model(name)
        engine.release_model(name)
        del runner
        free_memory()
    out["decode_b1_tps_by_round"] = by_round
    return out


def two_gpu_pool_rows(engine, loader, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    """2-rank pools (ClientEngine, GPUs 0 and 1, NCCL) against the single-GPU Engine: batch-1 decode interleaved
    round by round, with a pool stepping one step at a time and one with overlapped scheduling
    (ALLSPARK_OVERLAP=0 / 1), whether their greedy tokens agree with one GPU's, and each rank's graph replay
    alone (pool_step_micro.py)."""
    from allspark_client import ClientEngine
    vocab = LLAMA2_7B["vocab_size"]
    pools = {}
    try:
        for name, overlap in (("pool_2gpu", "0"), ("pool_2gpu_overlap", "1")):
            with settings.override(OVERLAP=overlap):   # the ranks inherit mpirun's environment
                pools[name] = ClientEngine(ranks=2)
            cfg = (loader.create_reference_runtime_config_builder("bench-pool", "cuda", [0, 1], max_batch=8)
                   .max_length(prompt_len + new_tokens + 16).kv_cache_span_size(32).build())
            pools[name].install_model(cfg)
            pools[name].start_model("bench-pool")
        prompt = W.prompt(prompt_len, 0, vocab)
        one = W.greedy_tokens(engine, "bench-cuda", prompt, 16)
        out = {}
        for name, client in pools.items():
            theirs = W.greedy_tokens(client, "bench-pool", prompt, 16)
            out[f"{name}_greedy_first_divergence_vs_1gpu"] = first_divergence(one, theirs)
            W.decode_tps(client, "bench-pool", vocab, 8)
        runs = {"engine_1gpu": [], **{name: [] for name in pools}}
        sides = [("engine_1gpu", engine, "bench-cuda")] + [(n, client, "bench-pool") for n, client in pools.items()]
        for r in range(rounds):
            for name, e, model in sides:
                runs[name].append(W.decode_tps(e, model, vocab, new_tokens, seed=r, prompt_len=prompt_len))
        out["decode_b1_tps_by_round"] = runs
        for name in pools:
            out[f"{name}_decode_b1_tps"] = statistics.median(runs[name])
            out[f"{name}_vs_1gpu"] = statistics.median(a / b for a, b in zip(runs[name], runs["engine_1gpu"]))
    finally:
        for client in pools.values():
            client.close()
    out["graph_replay"] = pool_graph_replay(loader)
    return out


def pool_graph_replay(loader) -> dict:
    """Each rank's batch-1 decode graph of a 2-rank pool replayed alone (pool_step_micro.py under mpirun)."""
    import json
    import subprocess
    import tempfile
    from allspark_client.launcher import find_mpirun
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "micro.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [find_mpirun("mpirun"), "-n", "2", "--bind-to", "none", sys.executable,
               os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_step_micro.py"),
               loader.graph_path, loader.weights_path, out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-2000:]}
        with open(out) as f:
            return json.load(f)


def time_graph_steps(graphs, batch: int):
    """Wrap graphs.run_decode to time each replayed step of exactly `batch` rows on the GPU (CUDA events around
    its copies and replay, in the real run: its contexts, not the static buffers' leftovers); returns a function
    that unwraps and gives the median milliseconds (diagnostic: the step's GPU time against its wall time)."""
    original, events = graphs.run_decode, []

    def timed(chunks, mirrors, *ids):
        if len(chunks) != batch:
            return original(chunks, mirrors, *ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original(chunks, mirrors, *ids)
        end.record()
        events.append((start, end))
        return out
    graphs.run_decode = timed

    def result():
        del graphs.run_decode
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) if events else None
    return result


def kernel_breakdown(runner, batch: int, top: int = 12) -> list:
    """The GPU kernels of one eager decode step of `batch` rows (the graph's static inputs) by total time:
    [(name, ms, calls)] (diagnostic: where the step's GPU time goes)."""
    from torch.profiler import ProfilerActivity, profile
    inputs = runner.graphs._inputs(batch)
    with torch.inference_mode():
        runner.model(inputs, runner.kv)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.model(inputs, runner.kv)
            torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [(e.key[:80], round(e.device_time_total / 1e3, 3), e.count) for e in rows]


def recaptured_graphs(runner, env: dict):
    """The runner's decode graphs captured again under the environment switches `env` (GRAPH_VARIANTS'): the
    other side of an A/B, swapped in as runner.graphs between requests."""
    from allspark_server.runner.cuda_graphs import DecodeGraphs
    g = runner.graphs
    with settings.override(env):
        return DecodeGraphs(runner.model, runner.kv, max(g.sizes), g.spans.shape[1], g.scratch_span, g.span_size,
                            g.spans.device)


@contextlib.contextmanager
def overlap_off(served):
    """Overlapped scheduling off for what runs inside (the model between requests: nothing in flight)."""
    was, served._overlap = served._overlap, False
    try:
        yield
    finally:
        served._overlap = was


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


MEMORY_GB: dict[str, float] = {}   # GPU memory allocated after each phase (diagnostic, in the report)


def note_memory(phase: str) -> None:
    MEMORY_GB[phase] = round(torch.cuda.memory_allocated() / 1e9, 2)


def engine_concurrent(engine, num: int, one_loop: bool = False) -> dict:
    """`num` requests of CONC_PROMPT in / CONC_NEW out submitted together: output tokens/s over the whole run and
    decode-only (tokens after the last request's first token over the time from then to the end), with the
    step profile and the GPU time of the decode steps of all `num` rows. Each request is read by a thread of its
    own blocked in Get() (DashInfer's examples), or with `one_loop` all on one asyncio loop as the HTTP server
    reads them (workloads.token_times_one_loop): the engine thread shares the GIL with every woken reader."""
    vocab = LLAMA2_7B["vocab_size"]
    served = engine._engine.models["bench-cuda"]
    profile = StepProfile(served)
    graph_ms = time_graph_steps(served.runner.graphs, num)
    prompts = [W.prompt(CONC_PROMPT, 500 + i, vocab) for i in range(num)]
    read = W.token_times_one_loop if one_loop else W.token_times_threads
    t0 = time.perf_counter()
    stamps = read(engine, "bench-cuda", prompts, CONC_NEW)
    end = max(s[-1] for s in stamps)
    all_first = max(s[0] for s in stamps)
    profile.restore()
    return {"allspark_tps": num * CONC_NEW / (end - t0),
            "allspark_decode_tps": sum(t > all_first for s in stamps for t in s) / (end - all_first),
            "first_tokens_s": all_first - t0, "steps": profile.summary(),
            f"graph_step_gpu_ms_b{num}": graph_ms()}


def concurrent_rows(engine, hf, weights, num: int) -> dict:
    """`num` requests of 128 in / 128 out submitted together to the Engine (output tokens/s over the whole
    run, and decode-only: tokens after the last request's first token over the time from then to the end),
    the peer's decode-only rate at batch `num` (graph replay) and transformers' static batch (generate)."""
    vocab = LLAMA2_7B["vocab_size"]
    served = engine._engine.models["bench-cuda"]
    row = engine_concurrent(engine, num)
    if num == 128:   # what overlapped scheduling gives here: the same run with it off
        with overlap_off(served):
            off = engine_concurrent(engine, num)
        row["no_overlap"] = {k: off[k] for k in ("allspark_tps", "allspark_decode_tps", "steps")}
    # the same requests read on one asyncio loop (the HTTP server's way): how much of the row is the readers' GIL
    loop = engine_concurrent(engine, num, one_loop=True)
    row["one_loop_readers"] = {k: loop[k] for k in ("allspark_tps", "allspark_decode_tps", "steps")}
    graphs = served.runner.graphs
    size = next(s for s in graphs.sizes if s >= num)
    row["graph_replay_ms"] = graph_replay_ms(graphs, size)
    row["kernels_top"] = kernel_breakdown(served.runner, size)
    free_memory()
    note_memory(f"c{num} engine")
    peer = peer_mod.StaticLlama(weights, batch=num, max_len=CONC_PROMPT + CONC_NEW + 8)
    peer.prefill_by_decoding(W.prompt(CONC_PROMPT, 500, vocab))
    peer.capture()
    row["torch_cuda_graph_decode_tps"] = peer.decode_tps(CONC_PROMPT, CONC_NEW)
    del peer
    free_memory()
    note_memory(f"c{num} peer freed")
    batch = [W.prompt(CONC_PROMPT, 500 + i, vocab) for i in range(num)]
    row["hf_static_batch_tps"] = num * CONC_NEW / hf_generate_s(hf, batch, CONC_NEW)
    free_memory()
    note_memory(f"c{num} hf generate")
    row["allspark_decode_vs_torch_cuda_graph"] = row["allspark_decode_tps"] / row["torch_cuda_graph_decode_tps"]
    row["allspark_vs_hf_static"] = row["allspark_tps"] / row["hf_static_batch_tps"]
    row["one_loop_readers"]["decode_vs_torch_cuda_graph"] = (row["one_loop_readers"]["allspark_decode_tps"]
                                                             / row["torch_cuda_graph_decode_tps"])
    return row
