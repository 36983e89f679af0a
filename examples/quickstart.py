"""allspark quick start: a 2-rank tensor-parallel pool serving a small model, streamed over gRPC.

    python examples/quickstart.py [--ranks 2] [--prompt TEXT] [--max-new-tokens 128]

Creates once (deterministically, under ~/.cache/allspark/quickstart) a small Llama-architecture
model with random weights and a locally trained tokenizer, serializes it, starts a pool with
allspark-launch (mpirun, one rank per core group), streams a completion through ClientEngine,
prints tokens/s, and shuts the pool down. The text is gibberish: the weights are random.
"""
from __future__ import annotations

import argparse
import os
import time

from allspark_client import ClientEngine
from allspark_server import HuggingFaceModel, TargetDevice
from allspark_server.loader.tiny_model import demo_model

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "allspark", "quickstart")
NAME = "quickstart-llama"


def prepare_model() -> HuggingFaceModel:
    hf_dir = os.path.join(CACHE, "hf")
    if not os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        print(f"creating a small random Llama model in {hf_dir} ...", flush=True)
    demo_model(hf_dir)
    model = HuggingFaceModel(hf_dir, NAME, user_set_data_type="float32")
    model.load_model().serialize_to_path(None, CACHE, skip_if_exists=True).free_model()
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()

    model = prepare_model()
    t0 = time.perf_counter()
    with ClientEngine(ranks=a.ranks) as engine:          # spawns the pool, waits on its health call
        print(f"pool of {engine.health.world_size} ranks ready in {time.perf_counter() - t0:.1f}s "
              f"({engine.get_version_full()})")
        runtime_cfg = model.create_reference_runtime_config_builder(NAME, TargetDevice.CPU_NUMA, [0], max_batch=8) \
            .max_length(1024).build()
        engine.install_model(runtime_cfg)
        engine.start_model(NAME)
        gen_cfg = model.create_reference_generation_config_builder(runtime_cfg)
        gen_cfg.update({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7, "max_new_tokens": a.max_new_tokens,
                        "eos_token_id": []})
        status, handle, queue = engine.start_request_text(NAME, model, a.prompt, gen_cfg)
        if status != 0:
            raise SystemExit(f"start_request_text: {status.name}: {engine.get_last_error()}")
        tokenizer = model.get_tokenizer()
        print(a.prompt, end="", flush=True)
        ids, shown = [], ""
        while (elements := queue.Get()) is not None:
            ids.extend(elements.ids_from_generate)
            text = tokenizer.decode(ids)
            print(text[len(shown):], end="", flush=True)
            shown = text
        stats = queue.RequestStatInfo()
        print(f"\n\n[{queue.GenerateStatus().name}] {len(ids)} tokens, TTFT {stats['time_to_first_token']} ms, "
              f"{stats['generate_tps']:.1f} tokens/s (2-rank tensor parallel over MPI, streamed over gRPC)")
        engine.release_request(NAME, handle)
        engine.stop_model(NAME)
        engine.release_model(NAME)
    print("pool shut down")


if __name__ == "__main__":
    main()
