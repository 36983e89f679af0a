"""Where a GPU prefill's time to first token goes: one Engine, one request of a long prompt and max_new_tokens=1.

    python benchmarks/gpu_ttft_profile.py [--cases smol-uint4_min full-int8+head ...] [--prompt 512] [--repeats 7]
                                          [--device cuda|cpu] [--out DIR] [--trace]

For each case (a random-weight benchmark model, quantized as named, served from its serialized file): the median
TTFT as workloads.first_token_s measures it (gguf_race.py's), then the same request with the runner's execute
wrapped to split it into phases (submit -> execute entered: the engine thread's wake-up and scheduling; execute's
host time: the forward's launches; a synchronize after it: the GPU's tail; then sampling, completion and delivery
to the caller's Get), then torch.profiler around two requests: the top ops by host and by device time, the kernel
launches and the host-device syncs; --graph: the bare forward of one such prefill, eager and replayed from a CUDA
graph (the cost without the host's per-op overhead). Writes <out>/ttft_profile.json and <out>/<case>_ops.txt;
prints a table.
--device cpu: a smoke test of this script (no timing meaning).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import torch
import workloads as W

# SmolLM2-135M's shape (GGUF race 'smollm2'): hidden 576, 30 layers, 9 heads of 64, 3 KV heads
SMOL = dict(hidden_size=576, num_layers=30, intermediate_size=1536, num_heads=9, num_kv_heads=3, vocab=49152)
TINY = dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab=512)
MODELS = {"smol": SMOL, "full": {k: common.FULL[k] for k in SMOL}, "tiny": TINY}
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
            "cudaMemcpy", "cudaStreamWaitEvent")
LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def serve(engine, case: str, device: str, prompt: int):
    """Install `case` ('<model>-<quant variant or bf16>') on the engine: (name, vocab, its ServedModel)."""
    from allspark_server import HuggingFaceModel
    model, _, variant = case.partition("-")
    spec = dict(MODELS[model], prompts=(prompt,), new_tokens=1, device=device)
    hf_dir = common.build_model(spec, "bfloat16")
    loader = HuggingFaceModel(hf_dir, case, user_set_data_type="bfloat16")
    quant = common.quant_variant(variant) if variant != "bf16" else None
    out = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "ttft-profile")
    loader.load_model().serialize_to_path(None, out, enable_quant=bool(quant), customized_quant_config=quant,
                                          skip_if_exists=False).free_model()
    assert engine.install_model(common.runtime_cfg(loader, case, spec, 4)) == 0, engine.get_last_error()
    assert engine.start_model(case) == 0, engine.get_last_error()
    return case, spec["vocab"], engine._models[case]


def phases(engine, name: str, served, ids: list[int], sync: bool, py_profile: str | None = None) -> dict:
    """One request's phases in ms (see the module docstring); py_profile: a path for cProfile's top functions of
    the execute call (the engine thread's Python)."""
    runner, marks = served.runner, {}
    orig = runner.execute

    def execute(plan, tokens=None):
        marks.setdefault("enter", time.perf_counter())
        if py_profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            out = pr.runcall(orig, plan, tokens)
            with open(py_profile, "w") as fh:
                pstats.Stats(pr, stream=fh).sort_stats("tottime").print_stats(45)
        else:
            out = orig(plan, tokens)
        marks.setdefault("exit", time.perf_counter())
        if sync and runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        marks.setdefault("gpu_done", time.perf_counter())
        return out
    runner.execute = execute
    try:
        t0 = time.perf_counter()
        status, handle, queue = engine.start_request(name, {"input_ids": ids}, dict(W.GREEDY, max_new_tokens=1))
        assert status == 0, engine.get_last_error()
        first = None
        while queue.Get() is not None:
            first = first or time.perf_counter()
        engine.release_request(name, handle)
    finally:
        del runner.execute
    ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
    return {"ttft": ms(t0, first), "to_execute": ms(t0, marks["enter"]),
            "execute_host": ms(marks["enter"], marks["exit"]),
            "gpu_tail": ms(marks["exit"], marks["gpu_done"]), "after": ms(marks["gpu_done"], first)}


def profile(engine, name: str, vocab: int, prompt: int, out_dir: str, trace: bool) -> dict:
    """torch.profiler around two requests: op tables written to out_dir, launch / sync counts returned."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:        # the forward runs on the engine thread: every thread's ops, and the CUDA syncs as events
        extra = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:
        extra = None
    with tprofile(activities=acts, experimental_config=extra) as prof:
        for r in range(2):
            W.first_token_s(engine, name, W.ttft_prompt(prompt, 500 + r, vocab, salt=9))
    ka = prof.key_averages()
    with open(os.path.join(out_dir, f"{name}_ops.txt"), "w") as fh:
        fh.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90) + "\n")
        if torch.cuda.is_available():
            fh.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90) + "\n")
    if trace:
        prof.export_chrome_trace(os.path.join(out_dir, f"{name}_trace.json"))
    events = prof.events()
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")
               and e.device_time_total > 0 and not e.cpu_children]
    counts = {op: sum(1 for e in events if e.name == op) // 2 for op in SYNC_OPS + LAUNCH_OPS}
    top_host = [(e.key, round(e.self_cpu_time_total / 2e3, 3), e.count // 2)
                for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]]
    top_dev = [(e.key, round(e.self_device_time_total / 2e3, 3), e.count // 2)
               for e in sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:15]]
    return {"per_request": {k: v for k, v in counts.items() if v},
            "kernel_ms_per_request": round(sum(e.device_time_total for e in kernels) / 2e3, 3),
            "kernels_per_request": len(kernels) // 2, "top_host_ms": top_host, "top_device_ms": top_dev}


def graph_ceiling(served, vocab: int, prompt: int, repeats: int) -> dict:
    """The model's forward over one `prompt`-token prefill chunk, called eagerly (host launches, then a sync) and
    replayed from a CUDA graph captured over the same static inputs: what the prefill costs without the host's
    per-op overhead (ms, medians). Writes the KV of spans 0.. (run it last, with no request live)."""
    from allspark_server.core.messages import ScheduledChunk
    from allspark_server.step.inputs import RequestMirror, build_forward_inputs
    runner = served.runner
    spans = list(range(-(-prompt // runner.span_size)))
    mirrors = {0: RequestMirror(W.ttft_prompt(prompt, 0, vocab, salt=11), spans, 0)}
    inputs = build_forward_inputs([ScheduledChunk(0, prompt, True)], mirrors, runner.span_size).to(runner.device)
    model, kv = runner.model, runner.kv

    def eager() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(inputs, kv)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)
    out = {"eager_forward_ms": statistics.median(eager() for _ in range(repeats))}
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            model(inputs, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            model(inputs, kv)

        def replay() -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            return 1e3 * (time.perf_counter() - t)
        out["graph_replay_ms"] = statistics.median(replay() for _ in range(repeats))
    except Exception as e:      # the ceiling is a lead, not the measure: say why it is missing
        out["graph_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["smol-uint4_min_g32", "full-int8_g32+head", "full-bf16"])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--trace", action="store_true", help="also write each case's chrome trace")
    p.add_argument("--graph", action="store_true", help="also time the bare forward, eager and from a CUDA graph")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from allspark_server import Engine
    engine, report = Engine(), {}
    try:
        for case in a.cases:
            t = time.perf_counter()
            name, vocab, served = serve(engine, case, a.device, a.prompt)
            print(f"{case}: built and installed in {time.perf_counter() - t:.1f} s", flush=True)
            for r in range(3):     # compile and warm every kernel of the prompt's shape
                W.first_token_s(engine, name, W.ttft_prompt(a.prompt, 900 + r, vocab, salt=9))
            ttfts = [1e3 * W.first_token_s(engine, name, W.ttft_prompt(a.prompt, r, vocab, salt=9))
                     for r in range(a.repeats)]
            split = [phases(engine, name, served, W.ttft_prompt(a.prompt, 100 + r, vocab, salt=9), sync=True)
                     for r in range(a.repeats)]
            rep = {"ttft_ms": statistics.median(ttfts), "ttft_all_ms": [round(t, 3) for t in ttfts],
                   "phases_ms": {k: round(statistics.median(s[k] for s in split), 3) for k in split[0]},
                   "profile": profile(engine, name, vocab, a.prompt, a.out, a.trace)}
            phases(engine, name, served, W.ttft_prompt(a.prompt, 700, vocab, salt=9), sync=True,
                   py_profile=os.path.join(a.out, f"{name}_py.txt"))
            report[case] = rep
            print(f"{case}: ttft {rep['ttft_ms']:.2f} ms, phases {rep['phases_ms']}, kernels "
                  f"{rep['profile']['kernels_per_request']} = {rep['profile']['kernel_ms_per_request']} ms, "
                  f"calls {rep['profile']['per_request']}", flush=True)
            if a.device == "cuda" and a.graph:
                rep["ceiling"] = graph_ceiling(served, vocab, a.prompt, a.repeats)
                print(f"{case}: {rep['ceiling']}", flush=True)
            with open(os.path.join(a.out, "ttft_profile.json"), "w") as fh:     # after each case: a cut run keeps it
                json.dump(report, fh, indent=1)
            assert engine.stop_model(name) == 0 and engine.release_model(name) == 0
            if a.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
