"""Load a HuggingFace model folder, serialize it, and stream a completion with the in-process Engine.

    python examples/stream_completion.py [MODEL_DIR] [--prompt TEXT] [--max-new-tokens N] [--dtype bfloat16]

Without MODEL_DIR a tiny random Llama model with a locally trained tokenizer is created first
(its text is gibberish; the point is the API flow).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from allspark_server import Engine, GenerateRequestStatus, HuggingFaceModel, TargetDevice
from allspark_server.loader.tiny_model import build_tiny_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="local HF model folder (default: build a tiny one)")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the model's)")
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "allspark_models"))
    a = p.parse_args()

    model_dir = a.model_dir
    if model_dir is None:
        model_dir = os.path.join(a.out_dir, "tiny-llama-hf")
        build_tiny_model(model_dir, "llama_gqa_llama3")
    name = os.path.basename(os.path.normpath(model_dir))

    engine = Engine()
    model = HuggingFaceModel(model_dir, name, user_set_data_type=a.dtype)
    model.load_model().serialize(engine, model_output_dir=a.out_dir).free_model()
    runtime_cfg = model.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=8) \
        .max_length(min(2048, model.get_model_context_length())).build()
    engine.install_model(runtime_cfg)
    engine.start_model(name)

    gen_cfg = model.create_reference_generation_config_builder(runtime_cfg)
    gen_cfg.update({"top_k": 1, "max_new_tokens": a.max_new_tokens})
    status, handle, queue = engine.start_request_text(name, model, a.prompt, gen_cfg)
    if status != 0:
        raise SystemExit(f"start_request_text failed: {status.name}: {engine.get_last_error()}")

    tokenizer = model.get_tokenizer()
    print(a.prompt, end="", flush=True)
    t0, ids = time.perf_counter(), []
    while True:
        elements = queue.Get()
        if elements is None:
            break
        shown = tokenizer.decode(ids)
        ids.extend(elements.ids_from_generate)
        print(tokenizer.decode(ids)[len(shown):], end="", flush=True)   # whole characters only
    elapsed = time.perf_counter() - t0
    final = queue.GenerateStatus()
    print(f"\n\n[{final.name}] {len(ids)} tokens in {elapsed:.2f}s "
          f"({len(ids) / elapsed:.1f} tokens/s, TTFT {queue.RequestStatInfo()['time_to_first_token']} ms)")
    engine.release_request(name, handle)
    engine.stop_model(name)
    engine.release_model(name)
    if final != GenerateRequestStatus.GenerateFinished:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
