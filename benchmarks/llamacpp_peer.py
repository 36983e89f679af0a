"""llama.cpp as a peer in the benchmark: the benchmark's HF Llama folder written as GGUF files (f32, f16,
q8_0, q4_0) with the `gguf` package, batch-1 decode through llama-cpp-python timed like our Engine's
(`workloads.decode_tps`), and a logits check against transformers that proves the conversion.

Owns only the conversion and the llama.cpp side; run.py decides what races what. Optional: without
`llama_cpp` / `gguf` installed, `missing()` says why and nothing else here is called.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
import time

import numpy as np
import workloads as W

FLASH_ATTN = True      # what llama.cpp itself picks on CPU ("auto"); llama-cpp-python's default is off
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


# llama.cpp's AMX backend (built in by -march=native on CPUs with AMX) segfaulted in its first q8_0 eval on a 2-core
# Sapphire-Rapids-class VM here (llama-cpp-python 0.3.36; f16 / bf16 ran), as ggml-org/llama.cpp#20824 reports
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
                '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF" pip install --force-reinstall '
                '--no-binary llama-cpp-python llama-cpp-python')
# llama.cpp built as for an AVX2-only CPU (gguf_race.py --as-avx2), into a folder of its own (--llama-cpp)
AVX2_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF '
              '-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" pip install '
              '--no-cache-dir --no-deps --no-binary llama-cpp-python --target DIR llama-cpp-python')


def missing(folder: str | None = None, avx2_only: bool = False) -> str | None:
    """None when the peer can run, else a sentence saying what is not importable, or that the build would crash.
    `folder`: import llama_cpp from there first (a build of its own); `avx2_only`: refuse a build with SIMD past
    AVX2 (gguf_race.py --as-avx2)."""
    if folder:
        sys.path.insert(0, os.path.abspath(folder))
    for module in ("llama_cpp", "gguf"):
        try:
            __import__(module)
        except ImportError:
            return f"llama.cpp peer skipped: `{module}` is not importable (pip install llama-cpp-python gguf)"
    import llama_cpp
    if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
        return ("llama.cpp peer skipped: this llama-cpp-python was built with llama.cpp's AMX backend, which "
                "segfaults on q8_0 here (ggml-org/llama.cpp#20824); rebuild it without AMX: " + NO_AMX_BUILD)
    wide = features_above_avx2() if avx2_only else []
    if wide:
        return (f"--as-avx2: this llama.cpp uses {', '.join(wide)}; build one without them into a folder and pass "
                f"it as --llama-cpp: {AVX2_BUILD}")
    return None


def peer_type(variant: str) -> str:
    """The llama.cpp type that races one of our InstantQuant variants: int8 -> q8_0 (groups of 32),
    4-bit (int4/uint4, any group) -> q4_0 (groups of 32); a '+head' suffix quantizes its output matrix too
    ('+a8', our int8 activations, has no llama.cpp counterpart beyond q8_0's own int8 activations)."""
    base, *suffixes = variant.split("+")
    qtype = {"int8": "q8_0", "uint8": "q8_0", "int4": "q4_0", "uint4": "q4_0"}[base.partition("_g")[0]]
    return qtype + ("+head" if "head" in suffixes else "")


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)                 # model.layers.<N>.<module>.weight
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def rotary_to_adjacent_pairs(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotates the two halves of each head (i, i + d/2); llama.cpp's Llama rope rotates adjacent pairs
    (2i, 2i + 1). Reorder each head's output rows so that row i and row i + d/2 become neighbours."""
    out_rows = w.shape[0]
    half = out_rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_config(cfg: dict) -> dict:
    """Rotary settings with the base frequency under 'rope_theta', from transformers 5's `rope_parameters`
    or older configs' `rope_scaling` + top-level `rope_theta`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """llama.cpp divides each rotary frequency by `rope_freqs.weight`; for Llama 3 rope scaling these are
    the divisors that transformers applies to its inverse frequencies."""
    rs = rope_config(cfg)
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = rs["rope_theta"]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)   # 0: long waves, 1: short waves
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def write_vocab(writer, vocab_size: int, bos: int, eos: int) -> None:
    """A placeholder SentencePiece-style vocabulary (the benchmark feeds token ids, never text): <s>, </s>,
    <unk>, the 256 byte tokens llama.cpp looks for, then `tok<N>` up to the model's vocab size."""
    import gguf
    tokens = ["<s>", "</s>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"tok{i}" for i in range(len(tokens), vocab_size)]
    types = ([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (vocab_size - 259))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores([-float(i) for i in range(vocab_size)])
    writer.add_token_types(types[:vocab_size])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(2)
    writer.add_add_bos_token(False)


def write_gguf(hf_dir: str, path: str, ftype: str) -> None:
    """Write `hf_dir` (Llama, safetensors) as a GGUF of `ftype`: 'f32', 'f16', 'bf16', 'q8_0', 'q4_0' or a
    quantized one with '+head'. Norms and rope factors stay f32; the token embedding stays in the dense type
    (f16 in quantized files: a decode reads one row of it); the attention and MLP matrices get `ftype`; the
    output matrix too in dense and '+head' files, f16 otherwise (like our InstantQuant, which keeps the LM
    head unless asked)."""
    import gguf
    import torch
    from safetensors import safe_open
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    qname, head, _ = ftype.partition("+head")
    qtype = gguf.GGMLQuantizationType[qname.upper()]
    dense = qtype if qname in ("f32", "f16", "bf16") else gguf.GGMLQuantizationType.F16
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    writer = gguf.GGUFWriter(path + ".tmp", "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(float(rope_config(cfg)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qname == "f32"
                         else gguf.LlamaFileType[f"MOSTLY_{qname.upper()}"])
    write_vocab(writer, cfg["vocab_size"], cfg.get("bos_token_id", 0), cfg.get("eos_token_id", 1))
    if (factors := llama3_rope_factors(cfg)) is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                w = f.get_tensor(hf_name).to(torch.float32).numpy()
                if hf_name.endswith("q_proj.weight"):
                    w = rotary_to_adjacent_pairs(w, heads)
                elif hf_name.endswith("k_proj.weight"):
                    w = rotary_to_adjacent_pairs(w, kv_heads)
                name = gguf_name(hf_name)
                if w.ndim == 1:
                    t = gguf.GGMLQuantizationType.F32
                elif name == "token_embd.weight" or (name == "output.weight" and not head):
                    t = dense
                else:
                    t = qtype
                data = gguf.quants.quantize(w, t)
                writer.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".tmp", path)


def gguf_file(hf_dir: str, ftype: str) -> str:
    """The cached GGUF of `hf_dir` in `ftype`, next to the HF folder; written if missing."""
    path = os.path.join(hf_dir, "gguf", f"model-{ftype}.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_gguf(hf_dir, path, ftype)
    return path


def gguf_bytes_per_token(path: str, kv_bytes: int) -> dict:
    """File size, and the bytes a decode token reads: every tensor once, token_embd one row (all of it
    when there is no output matrix, i.e. tied embeddings), plus `kv_bytes` of KV cache."""
    import gguf
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        one_row = t.name == "token_embd.weight" and "output.weight" in names
        total += int(t.n_bytes) // rows if one_row else int(t.n_bytes)
    return {"gguf_bytes": os.path.getsize(path), "bytes_per_token": total + kv_bytes}


def kv_bytes_f16(hf_dir: str, ctx: int) -> int:
    """llama.cpp's default KV cache is f16."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (2 * cfg["num_hidden_layers"] * ctx * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
            * head_dim * 2)


def features_above_avx2() -> list[str]:
    """The SIMD features past AVX2 that this llama-cpp-python's build uses (its system info's `NAME = 1`)."""
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return [f for f in ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")
            if f"{f} = 1" in info]


def build_info() -> dict:
    """What a report records of the llama.cpp it raced: versions, flash attention, the backends built in."""
    import importlib.metadata

    import llama_cpp
    return {"llama_cpp_python": llama_cpp.__version__, "flash_attn": FLASH_ATTN,
            "gguf": importlib.metadata.version("gguf"),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def load(path: str, threads: int, n_ctx: int, logits_all: bool = False, n_gpu_layers: int = 0):
    """llama.cpp's model and one context; n_gpu_layers -1 offloads every layer and the output (a CUDA build)."""
    from llama_cpp import Llama
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                 flash_attn=FLASH_ATTN, logits_all=logits_all, n_gpu_layers=n_gpu_layers, verbose=False)


def _next_token(llm) -> int:
    """Greedy: argmax of the last evaluated position's logits, read in place."""
    import llama_cpp
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(logits.argmax())


def decode_tps(llm, vocab: int, new_tokens: int, seed: int = 0) -> float:
    """Batch-1 decode tokens/s as `workloads.decode_tps` measures ours: the same prompt, then `new_tokens`
    greedy tokens; the clock runs from the first generated token to the last (prefill excluded)."""
    llm.reset()
    llm.eval(W.prompt(W.DECODE_PROMPT_LEN, seed, vocab))
    token = _next_token(llm)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = _next_token(llm)
    return (new_tokens - 1) / (time.perf_counter() - t0)


def check_against_transformers(hf_dir: str, paths: dict, threads: int, num_tokens: int = 48) -> dict:
    """Logits of llama.cpp on each GGUF in `paths` vs transformers (fp32) on the HF folder, for one prompt:
    share of positions with the same top-1 token, relative L2 error of all logits, the worst position's
    cosine similarity, and the largest absolute difference in units of the reference's logit std."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = W.prompt(num_tokens, 7, hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy().astype(np.float64)      # [T, V]
    del hf
    out = {}
    for key, path in paths.items():
        llm = load(path, threads, n_ctx=256, logits_all=True)
        llm.eval(ids)
        got = np.array(llm.scores[:num_tokens], dtype=np.float64)               # [T, V]
        del llm
        cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
        out[key] = {"top1_agree": float((got.argmax(1) == ref.argmax(1)).mean()),
                    "rel_l2_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                    "min_cosine": float(cos.min()),
                    "max_abs_err_in_std": float(np.abs(got - ref).max() / ref.std())}
    return out
