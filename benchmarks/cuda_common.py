"""What the GPU benchmarks share: the Llama-2-7B-shaped benchmark model and its files, GPU timing of graph replays
and kernel calls, the A/B helpers (graphs captured again under other settings, overlap off) and GPU memory notes.

The bottom of the GPU side of benchmarks/: cuda_rows.py, cuda_bench.py, pool_step_micro.py and the kernel
micro-benchmarks import it; it imports no other benchmark module. Without a GPU (the smoke tests) `time_us` times one
call by the wall clock: the kernels then run in Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time

import torch

from allspark_client import settings
from allspark_server.compute.cuda.cuda_device import gpu_copy_bandwidth_gbs

if not torch.cuda.is_available():   # a smoke run: Triton's interpreter (read as @triton.jit decorates: import us first)
    os.environ.setdefault("TRITON_INTERPRET", "1")

LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)
# `run.py --device cuda --smoke`: the same vocabulary and head size, two narrow layers (checks that every row runs)
SMOKE_SHAPE = dict(LLAMA2_7B, hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=2,
                   num_key_value_heads=2)


CONC_PROMPT, CONC_NEW = 128, 128   # the concurrent rows: 128 tokens in, 128 out


def copy_bandwidth_gbs(nbytes: int = 2 << 30, repeats: int = 20) -> float:
    return gpu_copy_bandwidth_gbs(torch.device("cuda"), nbytes, repeats)


def device() -> str:
    """Where the micro-benchmarks put their tensors: the GPU, else the CPU (Triton's interpreter: a smoke run)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def time_us(fn) -> float:
    """Microseconds of one call of fn, timed as CUDA-graph replays (triton.testing.do_bench_cudagraph); without a GPU
    one call by the wall clock (no timing meaning)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    import triton.testing
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20)


def per_call_us(fn, ws: list) -> float:
    """Microseconds a call of fn(w), replayed over every copy of a weight in turn (copies past L2's 50 MB: a decode
    step reads each weight once, from memory)."""
    return time_us(lambda: [fn(w) for w in ws]) / len(ws)


COPIES_BYTES = 600 << 20      # what one timed call walks through: well past the 50 MB of L2


def copies_past_l2(one_bytes: int) -> int:
    """How many copies of a weight of `one_bytes` make COPIES_BYTES (at least 2)."""
    return max(2, -(-COPIES_BYTES // one_bytes))


def replay_median_ms(graph, repeats: int, warmup: int = 10) -> float:
    """Median ms of one replay of a CUDA graph (device events around each, after `warmup` replays)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


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


def bench_shape(layers: int, smoke: bool = False) -> dict:
    """The benchmark model's shape: Llama-2-7B's with `layers` layers, or SMOKE_SHAPE."""
    return dict(SMOKE_SHAPE) if smoke else dict(LLAMA2_7B, num_hidden_layers=layers)


def bench_root(shape: dict) -> str:
    """Where the benchmark's HF folder and its serialized model (as/) live."""
    layers = shape["num_hidden_layers"]
    name = (f"llama2-7b-{layers}l" if shape["hidden_size"] == LLAMA2_7B["hidden_size"]
            else f"smoke-{shape['hidden_size']}h-{layers}l")
    return os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench-cuda", name)


def serialized_bench_model(root: str):
    """The HF folder at `root` serialized as model 'bench-cuda' into root/as (once): its loader."""
    from allspark_server import HuggingFaceModel
    loader = HuggingFaceModel(root, "bench-cuda", user_set_data_type="bfloat16")
    loader.load_model().serialize_to_path(None, os.path.join(root, "as"), skip_if_exists=True).free_model()
    return loader


def quantized_bench_model(root: str, variant: str):
    """The HF folder at `root` quantized as common.quant_variant(`variant`) says, serialized as model
    'bench-cuda-<variant>' into root/as-<variant> (once): its loader."""
    import common

    from allspark_server import HuggingFaceModel
    loader = HuggingFaceModel(root, f"bench-cuda-{variant}", user_set_data_type="bfloat16")
    loader.load_model().serialize_to_path(None, os.path.join(root, f"as-{variant}"), enable_quant=True,
                                          skip_if_exists=True,
                                          customized_quant_config=common.quant_variant(variant)).free_model()
    return loader


def kv_bytes_per_token(shape: dict) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2   # bf16 K and V, every layer


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    """The first position where two greedy continuations differ (their length if nowhere)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def build_model(out_dir: str, shape: dict) -> None:
    """A random bf16 HF folder of `shape` (weights N(0, 0.02), initialized on the GPU for speed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return
    cfg = LlamaConfig(**shape, max_position_embeddings=4096,
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
    """The served model stepping one step at a time for what runs inside (as with ALLSPARK_OVERLAP=0): its step loop
    swapped for a SerialLoop (engine/step_loops.py), between requests. A request's last decode step may still be in
    flight when its caller has every token (the overlapped loop completes it on its next call): that is waited for
    first, so that no step is left behind in the loop swapped out."""
    from allspark_server.engine.step_loops import SerialLoop
    idle(served)
    was, served.loop = served.loop, SerialLoop()
    try:
        yield
    finally:
        idle(served)
        served.loop = was


def idle(served, timeout_s: float = 60.0) -> None:
    """Wait until the served model has no step in flight and nothing scheduled."""
    deadline = time.monotonic() + timeout_s
    while served.has_work:
        if time.monotonic() > deadline:
            raise TimeoutError("the served model still has work: overlap_off needs it between requests")
        time.sleep(0.001)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


MEMORY_GB: dict[str, float] = {}   # GPU memory allocated after each phase (diagnostic, in the report)


def note_memory(phase: str) -> None:
    MEMORY_GB[phase] = round(torch.cuda.memory_allocated() / 1e9, 2)
