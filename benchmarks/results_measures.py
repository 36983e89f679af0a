"""The measures benchmarks/RESULTS.md lists: each results file's measure name -> (title, how it was run, the
reader of results_readers.py that turns its JSON into table rows)."""
from __future__ import annotations

from results_readers import (
    ab_trees,
    accuracy_smollm2,
    batch_invariance,
    cpu_attention,
    engines,
    features,
    gguf_race,
    int8_gemm,
    kv,
    lora,
    moe,
    multi_host,
    prefill_attention,
    prefill_gemm,
    quant,
    quant_accuracy,
    serve,
    serve_burst,
    speculative,
    speculative_verify,
    switch_interval,
    vl,
)
from results_readers_gpu import (
    allreduce,
    cuda,
    cuda_fp8,
    cuda_gemv_lora,
    cuda_gemv_micro,
    cuda_gemv_sweep,
    cuda_quant_micro,
    cuda_quant_silu,
    cuda_quant_sweep,
    decode_attention_sweep,
    lora_kernels_micro,
    pool_step,
)

MEASURES = {
    "ab-redesign": ("A/B: the layer-description redesign against the commit before it", "`ab_trees.py --old "
                    "<checkout of 737f874>`: each tree in its own process; the CPU rows with both engines resident, "
                    "taking turns; the H200 row from an earlier version of the script (a process per round).",
                    ab_trees),
    "ab-step-interface": ("A/B: the step binder, Granite's options and the one sampler against 9d3dcff",
                          "`ab_trees.py --old <checkout of 9d3dcff>`, each tree's Engine resident, taking turns: on "
                          "a GPU (`--device cuda --variants bf16`) Llama-2-7B-shaped bf16 with 16 layers, on a CPU "
                          "the 0.5 B benchmark model on 2 cores.", ab_trees),
    "ab-one-place": ("A/B: the family hooks, Granite in five files and the device chosen once against f227d4e",
                     "`ab_trees.py --old <checkout of f227d4e>`, each tree's Engine resident, taking turns: on a GPU "
                     "(`--device cuda --variants bf16`) Llama-2-7B-shaped bf16 with 16 layers, on a CPU the 0.5 B "
                     "benchmark model on 2 cores.", ab_trees),
    "batch-invariance": ("CPU: what batch-invariant mode costs", "`batch_invariance.py --rounds N`: the model "
                         "installed twice in one Engine, mode off and on, alternating rounds on 2 cores; SmolLM2's "
                         "Q4_1 file and the 0.5 B benchmark model as Q4_1 and in bf16.", batch_invariance),
    "speculative": ("Speculative decoding against plain decoding", "`speculative.py --rounds 3` (`--device cuda` on a "
                    "GPU): SmolLM2's Q4_1 file installed plain and with ngram speculation (k = 4) in one Engine, "
                    "alternating rounds; ratios of output tokens/s. GPU verify rows are computed as one-row steps "
                    "(compute/row_mode.py); the AVX2 and H200 runs also have the back-off (speculation.py), the "
                    "H100 run predates it. Files with prefix_cache false ran without the prefix cache, every round "
                    "computing its prompts whole as the warm-up round does; in the others a measured round's "
                    "rewrite prompt hit the cache, and with bf16 or int8 x the continuation it timed could differ "
                    "from the warm-up's (Zen 4, `--a8`, on 2026-11-30: 1.42x with the cache, 1.97x without).",
                    speculative),
    "lora": ("LoRA adapters against the base model", "`lora.py --device cuda --model 7b --rounds 3`: a random "
             "Llama-2-7B-shaped bf16 model installed plain and with 8 rank-16 adapters (all seven projections) in "
             "one Engine, alternating rounds; the decode steps replay CUDA graphs (those captured with adapters "
             "where a row has one). The H100 run predates the grouping of decode rows by adapter slot in "
             "lora_kernels.py; the H200 run has a program a row at one or two rows (its slot and first tile read "
             "before the PDL wait; the GEMV tiles of `cuda_gemv_micro.py --lora-sweep`) and at 32 the grouped "
             "launches beside each GEMM, their fp32 deltas added by the kernel that reads the projection next "
             "(compute/pending_delta.py). The streams' time includes their prompt steps, which run eagerly (their "
             "adapter rows through two GEMMs over every slot, lora_dense.py).", lora),
    "lora-kernels-micro": ("LoRA's kernels alone: a 7B-shaped step's projections in one CUDA graph",
                           "`lora_kernels_micro.py`: the four projections of 32 layers (bf16, distinct weights) "
                           "replayed without adapters and with rank-16 adapters on all seven modules: lora_add_'s "
                           "two launches after each projection, or (one row) the shrink inside the GEMV's launch "
                           "and the expand after it, or (32 rows, over 8 adapters in turn) the grouped launches "
                           "after the GEMM, the shrink beside it, or both beside it with the deltas added by the "
                           "residual add + RMSNorm and silu·mul (deferred; q|k|v's stay beside). Every variant "
                           "ends o and down with that norm.",
                           lora_kernels_micro),
    "lora-dense": ("LoRA adapters against the base model, SmolLM2 on a CPU", "`lora.py --model smollm2-dense "
                   "--dtype D --rounds 4` on 2 cores: SmolLM2's weights (dequantized from the Q4_1 file) plain and "
                   "with 8 rank-16 adapters, alternating rounds. At this size 8 fp32 adapters are ~30% of the base "
                   "model's bytes. The avx2 files (both dtypes) predate the CPU LoRA kernel's panels and its one "
                   "parallel region a step; lora-dense-as-avx2 runs today's AVX2 code on an AVX-512 VM.", lora),
    "lora-dense-fp32": ("LoRA adapters against the base model, SmolLM2 in fp32 on a CPU", "As above, `--dtype "
                        "float32`.", lora),
    "lora-dense-as-avx2": ("LoRA adapters against the base model, SmolLM2 on a CPU, its AVX2 code",
                           "`lora.py --model smollm2-dense --as-avx2`: the native kernels' AVX2 code and ATen capped "
                           "at AVX2 on an AVX-512 machine (an indication for AVX2-only machines: their cores and "
                           "memory differ).", lora),
    "lora-dense-fp32-as-avx2": ("LoRA adapters against the base model, SmolLM2 in fp32 on a CPU, its AVX2 code",
                                "As above, `--dtype float32`.", lora),
    "vl-2b": ("Qwen2-VL-2B-shaped model: concurrent image requests and multi-turn against transformers",
              "`vl.py --device cuda --model 2b`: a random Qwen2-VL-2B-shaped bf16 model; 32 single-image chats "
              "started together (448x448 noise images, 64 greedy tokens each) through the Engine against "
              "transformers' generate on the same prompts as one left-padded batch, alternating rounds (5 after a "
              "warm-up); then one chat's turn 2 after turn 1 with the same image against the same ids with a fresh "
              "image. See docs/performance.md.", vl),
    "speculative-a8": ("Speculative decoding against plain decoding, SmolLM2's codes met by int8 x",
                       "`speculative.py --a8 --rounds 3`: as above, the Q4_1 file served with activate_quant (x "
                       "rounded to int8 per row, as `gguf_race.py --ours gguf-a8`): the verify rows meet the codes "
                       "in vpdpbusd on AVX-512 VNNI CPUs.", speculative),
    "speculative-as-avx2": ("Speculative decoding, SmolLM2's Q4_1 file on a CPU, its AVX2 code",
                            "`speculative.py --rounds 2` with --as-avx2: the native kernels' AVX2 code and ATen "
                            "capped at AVX2 on an AVX-512 VM, an indication for AVX2-only machines (their cores and "
                            "memory differ).", speculative),
    "speculative-a8-as-avx2": ("Speculative decoding, SmolLM2's codes met by int8 x on a CPU, its AVX2 code",
                               "`speculative.py --a8 --rounds 2` with --as-avx2: as above.", speculative),
    "speculative-k8": ("Speculative decoding, SmolLM2's Q4_1 file, 8 proposed tokens",
                       "`speculative.py --tokens 8 --rounds 3`: as the speculative rows with k = 8.", speculative),
    "speculative-a8-k8": ("Speculative decoding with int8 x, 8 proposed tokens",
                          "`speculative.py --a8 --tokens 8 --rounds 3`: as above with k = 8.", speculative),
    "speculative-dense": ("Speculative decoding against plain decoding, SmolLM2 in bf16", "`speculative.py --model "
                          "smollm2-dense --draft smollm2 --rounds 3`: SmolLM2's weights in bf16 (dequantized from "
                          "the Q4_1 file) plain, with ngram speculation and with the Q4_1 file itself as the draft "
                          "model (k = 4).", speculative),
    "speculative-dense-k8": ("Speculative decoding, SmolLM2 in bf16, 8 proposed tokens", "`speculative.py --model "
                             "smollm2-dense --tokens 8 --rounds 2`: as above with k = 8, so that a GPU takes "
                             "invariant rows (model_runner.speculates_in_invariant_rows) and is compared with the "
                             "plain model in batch-invariant mode.", speculative),
    "speculative-dense-k8-alone": ("Speculative decoding, SmolLM2 in bf16, 8 proposed tokens, alone rows",
                                   "`speculative.py --model smollm2-dense --tokens 8 --rows alone --rounds 2`: as "
                                   "above, each GPU verify row by the one-row kernels.", speculative),
    "speculative-dense-invariant": ("Speculative decoding, SmolLM2 in bf16, invariant rows",
                                    "`speculative.py --model smollm2-dense --rows invariant --rounds 2`: k = 4, a "
                                    "GPU in invariant rows in every step.", speculative),
    "speculative-self-draft": ("Speculative decoding with the target's own quantized copy as the draft",
                               "`speculative.py --draft self`, k = 4: on a CPU `--model smollm2-dense --dtype "
                               "float32 --draft-quantize int8` (SmolLM2's weights in fp32 against their own "
                               "InstantQuant int8 copy), on a GPU `--device cuda --model 7b --layers 8 "
                               "--draft-quantize uint4` (a 7B-wide random bf16 model, 8 of its 32 layers, against "
                               "its uint4 copy: random weights repeat nothing for ngram, and 4-bit noise changes "
                               "their near-flat argmax).", speculative),
    "speculative-self-draft-ls0.005": ("Speculative decoding, a 7B-shaped model its own 4-bit copy can follow",
                                       "`speculative.py --device cuda --model 7b --layer-scale 0.005 --draft self "
                                       "--draft-quantize uint4_g128+fp_head --rounds 2`: all 32 layers, embeddings "
                                       "and LM head drawn with std 1 and the layers' weights with std 0.005, so "
                                       "that the greedy tokens of the copy (uint4 in groups of 128, the target's "
                                       "bf16 head) mostly agree; k = 4.", speculative),
    "speculative-7b": ("GPU: speculative decoding where nothing is accepted, invariant rows", "`speculative.py "
                       "--device cuda --model 7b --layers 8 --rounds 2`: a 7B-wide random bf16 model (8 of its 32 "
                       "layers) plain, in batch-invariant mode (the GEMVs a speculating model of its size takes) "
                       "and with ngram speculation (random weights repeat nothing: what a step pays when lookup "
                       "finds nothing).", speculative),
    "speculative-streams4": ("Speculative decoding at 4 concurrent streams", "`speculative.py --streams 4 --rounds "
                             "2`: as above, SmolLM2's Q4_1 file, the streams workload with 4 random prompts at once "
                             "(at most speculative_max_batch, its default 4: every request may speculate).",
                             speculative),
    "speculative-verify": ("GPU: what a speculative verify step costs", "`speculative_verify_cost.py --model "
                           "smollm2|7b --layers 8 --max-batch 4 --ctx 1,1024 --extra 3,5,6`: the decode graphs' "
                           "replay times by row count (the 7B-wide model with 8 of its 32 layers) and the verify "
                           "graph's of 5 rows (alone-rows mode: each row computed as a one-row step; a speculating "
                           "model of hidden size >= 2048 in invariant-rows mode, against its own and a plain model's "
                           "one-row graph).",
                           speculative_verify),
    "engines": ("CPU: Engine against transformers", "`run.py`: batch-1 decode, concurrency, TTFT, 2-rank pool; "
                "0.5 B Llama-shaped model, random weights.", engines),
    "engines-bf16": ("CPU: Engine against transformers, bf16 only", "`run.py --dtypes bfloat16 --no-pool "
                     "--no-llamacpp`: fresh prompts for every TTFT.", engines),
    "llamacpp-bf16": ("CPU: bf16 against llama.cpp", "`run.py --decode-only --no-pool --no-hf --dtypes bfloat16 "
                      "--rounds 21`: the same weights as f16 / bf16 GGUF files.", quant),
    "gguf-race": ("CPU and GPU: the same GGUF file served by allspark and llama.cpp", "`gguf_race.py --rounds 5`: "
                  "SmolLM2-135M-Instruct Q4_1 and the 0.5 B benchmark model written as Q8_0 / Q4_0 with its LM head, "
                  "each served by both sides on the same threads (llama-cpp-python, parallel slots for the "
                  "streams), interleaved rounds; on a GPU `gguf_race_gpu.py --rounds 5`: ours on a CUDA rank, "
                  "llama.cpp (a CUDA build) with every layer offloaded.", gguf_race),
    "gguf-race-a8": ("CPU: the same GGUF file, ours with int8 activations", "`gguf_race.py --ours gguf-a8 --files "
                     "smollm2 q4_0+head --rounds 5`: the race above, our side serving the file's codes with x rounded "
                     "to int8 per token (compute_method activate_quant), as llama.cpp rounds its activations.",
                     gguf_race),
    "gguf-race-a8-bytes": ("CPU: the same GGUF file, ours with int8 activations met as bytes by 8-bit codes too",
                           "`gguf_race.py --ours gguf-a8 --files q8_0+head q4_0+head smollm2 --rounds 3`: the race "
                           "above after 8-bit codes met int8 x with vpdpbusd (they took vpdpwssd before).", gguf_race),
    "gguf-race-a8-lanes": ("CPU: the same GGUF file, ours with int8 activations, block sums in lanes",
                           "`gguf_race.py --ours gguf-a8 --files q4_0+head q8_0+head smollm2 --rounds 3`: the race "
                           "above after grouped weights met 8+ rows of int8 x with each block's sum in one lane "
                           "(native/gemv_quant_lanes.cpp) and the KV cache's pages were faulted in at creation.",
                           gguf_race),
    "gguf-race-a8-dp": ("CPU: the same GGUF file, ours with int8 activations, bf16 dot-product attention",
                        "`gguf_race.py --ours gguf-a8 --files q4_0+head q8_0+head smollm2 --rounds 3`: the race "
                        "above after decode attention over the bf16 KV cache took vdpbf16ps (ISA level 4) and the "
                        "lanes GEMV's scratch moved to cache-line boundaries.", gguf_race),
    "gguf-race-a8-dp-q4_0": ("CPU: the same GGUF file, ours with int8 activations, bf16 dot-product attention, "
                             "a second run", "`gguf_race.py --ours gguf-a8 --files q4_0+head --rounds 3`: the race "
                             "above again on the Q4_0 file alone, minutes later.", gguf_race),
    "gguf-race-a8-prefill": ("CPU: the same GGUF file, ours with int8 activations, prompt rows on the int8 kernel",
                             "`gguf_race.py --ours gguf-a8 --rounds 3 --quiet-cores 0.15 --ttft-prompts 512 2048 "
                             "3960`: the race above after prompt rows of grouped int8-x weights stayed on the native "
                             "lanes kernel (QuantWeight::native_at_any_rows), TTFT at three prompt lengths.",
                             gguf_race),
    "gguf-race-as-avx2": ("CPU: the same GGUF file, both sides on AVX2 code paths",
                          "`gguf_race.py --as-avx2 --llama-cpp DIR --ours gguf-a8 --rounds 3 --quiet-cores 0.15 "
                          "--ttft-prompts 512 2048`: the race above with ours capped at AVX2 (ALLSPARK_CPU_ISA, ATen, "
                          "oneDNN and MKL) against llama.cpp built without AVX-512 and AVX-VNNI: an indication for "
                          "AVX2-only machines from a newer one. Int8 codes in groups of 32 on the AVX2 lanes kernel.",
                          gguf_race),
    "prefill-attention": ("CPU: a prompt chunk's causal attention, native kernel against ATen's SDPA",
                          "`prefill_attention_micro.py --rounds 5`: one layer of the 0.5 B model's heads (12 over 4 "
                          "KV heads, D 128), the context scattered over spans, 2 threads.", prefill_attention),
    "prefill-attention-as-avx2": ("CPU: a prompt chunk's causal attention on AVX2 code paths",
                                  "`prefill_attention_micro.py --as-avx2 --rounds 5`: as above with the kernel's AVX2 "
                                  "code and ATen capped at AVX2: an indication for AVX2-only machines from a newer "
                                  "one.", prefill_attention),
    "prefill-gemm": ("CPU: prompt rows against quantized weights, native int8 kernel against the dequantized GEMM",
                     "`prefill_gemm.py --rows 128 512 2048 --layers 2 --rounds 5`: the 0.5 B model's four weight "
                     "shapes, int8 x; multiply-adds per second against the vpdpbusd (vdpbf16ps for the dense bf16 "
                     "GEMM) peak measured in the same run.", prefill_gemm),
    "prefill-gemm-as-avx2": ("CPU: prompt rows against quantized weights on AVX2 code paths",
                             "`prefill_gemm.py --as-avx2 --rows 128 512 2048 --layers 2 --rounds 5`: as above with "
                             "ATen, oneDNN and MKL capped at AVX2 and the native kernels at ISA level 1 (the AVX2 "
                             "lanes kernel for 4-bit codes in groups of 32; BYTES8 row by row for int8), ATen's GEMM "
                             "in fp32: an indication for AVX2-only machines from a newer one.", prefill_gemm),
    "quant": ("CPU: quantized weights and KV against bf16 and llama.cpp",
              "`run.py --decode-only --quant ... --kv ...`: "
              "InstantQuant variants in the same rounds as the bf16 model and llama.cpp's GGUF peers.", quant),
    "quant-a8": ("CPU: int8 weights with and without int8 activations", "`run.py --decode-only --quant int8 int8+a8`.",
                 quant),
    "quant-a8head": ("CPU: 4-bit and 8-bit weights with int8 activations and LM head", "`run.py --decode-only "
                     "--no-llamacpp --quant int8+a8+head int4_g32+a8+head int4_g64+a8+head int4_g128+a8+head`.", quant),
    "quant-ttft": ("CPU: TTFT with quantized weights",
                   "`run.py --decode-only --ttft --quant ...`: TTFT relative to the "
                   "bf16 model's (medians of same-round ratios; where a file has none, the ratio of medians).", quant),
    "kv": ("CPU: quantized KV cache", "`run.py --decode-only --kv int8 uint4 [--kv-weights ...]`.", kv),
    "cpu-attention": ("CPU: decode attention kernels", "`cpu_decode_attention.py`: 16 layers, bf16 / int8 / uint4 "
                      "spans.", cpu_attention),
    "int8-gemm": ("CPU: AMX int8 GEMM for prefill", "`int8_gemm.py`: TTFT of int8 + a8 + head weights.", int8_gemm),
    "moe": ("CPU: mixture of experts", "`moe.py`: Qwen3-MoE-shaped model, random weights.", moe),
    "features": ("CPU: prefix cache and guided JSON", "`run.py --features`.", features),
    "multi-host": ("CPU: 2-host pool", "`multi_host.py`: two network-namespace hosts against one host.", multi_host),
    "serve": ("HTTP server against the Engine API", "`serve.py`: Poisson load through allspark-serve.", serve),
    "serve-burst": ("HTTP server bursts", "`serve.py --burst N`: N streams at once.", serve_burst),
    "quant-accuracy": ("Quantization accuracy, 0.5 B model", "`quant_accuracy.py`: teacher-forced against fp32.",
                       quant_accuracy),
    "quant-accuracy-quick": ("Quantization accuracy, small model", "`quant_accuracy.py --quick`.", quant_accuracy),
    "accuracy-smollm2": ("Accuracy on SmolLM2-135M-Instruct: weight formats x KV modes", "`accuracy_table.py`: "
                         "perplexity over 20,480 tokens of pydoc_data.topics, KL(p_fp32 || p) and top-1 agreement "
                         "against transformers' fp32 model of the same GGUF file; dense KV is fp32 for the fp32 row, "
                         "bf16 for the others.", accuracy_smollm2),
    "cuda": ("GPU: Engine against a PyTorch CUDA-graph step and transformers", "`run.py --device cuda`: "
             "Llama-2-7B-shaped bf16 model, random weights.", cuda),
    "cuda-gemv-micro": ("GPU: Triton decode GEMV", "`cuda_gemv_micro.py`: Llama-2-7B shapes and 2-rank shards.",
                        cuda_gemv_micro),
    "cuda-gemv-micro-smollm2": ("GPU: Triton decode GEMV tiles for small K", "`cuda_gemv_micro.py --shapes smollm2 "
                                "--sweep`: SmolLM2's bf16 shapes, one row, over 2-16 rows a program, 512- or "
                                "1024-wide k-tiles and 4 or 8 warps (where choose_config's wide-weight tile came "
                                "from: the LM head).", cuda_gemv_sweep),
    "cuda-gemv-lora": ("GPU: Triton decode GEMV tiles with a LoRA adapter", "`cuda_gemv_micro.py --lora-sweep`: "
                       "the LoRA benchmark's 7B shapes (8 KV heads) and 2-rank shards at one row, each 8-warp tile "
                       "alone and carrying a rank-16-per-module adapter's shrink, its expand after it (tiles as "
                       "(rows a program, k-tile)). The H200 file ran a first form of choose_config's rule, mended "
                       "after it: the tile now is [2, 2048] for qkv_gqa_tp2 and [8, 1024] for o_tp2.",
                       cuda_gemv_lora),
    "cuda-fp8": ("GPU: FP8 weights, KV spans and W8A8 against bf16", "`cuda_fp8.py --kv --ab-silu` (and "
                 "`--w8a8`): the 7B shape, one engine, rounds interleaved.", cuda_fp8),
    "cuda-quant-micro": ("GPU: quantized matmul", "`cuda_quant_micro.py`: each format against cuBLAS on bf16.",
                         cuda_quant_micro),
    "cuda-quant-sweep": ("GPU: quantized GEMV launch configs", "`cuda_quant_micro.py --sweep-only`.", cuda_quant_sweep),
    "cuda-quant-sweep-uint4": ("GPU: uint4 GEMV launch configs, groups of 128", "`cuda_quant_micro.py --sweep-only "
                               "--formats uint4:128`: the decode row of a 7B-shaped model's 4-bit copy (what a "
                               "self-draft reads).", cuda_quant_sweep),
    "cuda-quant-silu": ("GPU: silu·mul as the quantized GEMV's epilogue", "fused against two launches, one row.",
                        cuda_quant_silu),
    "decode-attention-sweep": ("GPU: decode attention launch shapes", "`decode_attention_sweep.py`.",
                               decode_attention_sweep),
    "allreduce": ("GPU: allreduce of one decode step's activations", "`allreduce_micro.py`: in CUDA graphs of 64 "
                  "calls.", allreduce),
    "pool-step": ("GPU: a 2-rank pool's decode graph", "`pool_step_micro.py`: each rank's graph replayed alone.",
                  pool_step),
    "switch-interval": ("GPU: Python's switch interval", "`switch_interval_ab.py`, a one-off A/B of "
                        "`sys.setswitchinterval` under 64 and 128 concurrent streams (the script is in git history).",
                        switch_interval),
}
