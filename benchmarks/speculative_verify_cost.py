"""What a speculative verify step costs on a GPU against a one-row decode step: the replay time of the decode graphs
(runner/cuda_graphs.py) per ladder size and of the verify graphs (captured in alone-rows mode, 1 + k rows per
request: "v5" is a verify chunk of batch 1 at k = 4), for a model installed with ngram speculation. Plain sizes
missing from the ladder (1 + k itself, say) are captured here the way DecodeGraphs captures its own, to show what
a verify step of plain decode rows would cost. The same model installed without speculation ("plain": its decode
GEMVs are not the batch-invariant ones a speculating model takes, compute/row_mode.py) gives the one-row graph the
verify graph is also set against.

    python benchmarks/speculative_verify_cost.py --model smollm2 --json out.json
    python benchmarks/speculative_verify_cost.py --model 7b --layers 8          # 7B-wide random bf16 layers

Every row is a padding row of the graphs (token 0, all spans the scratch span) with a context of --ctx tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import build_model, write_report  # noqa: E402

SHAPES = {
    "7b": dict(hidden_size=4096, num_layers=32, intermediate_size=11008, num_heads=32, num_kv_heads=8, vocab=32000),
    "1b": dict(hidden_size=2048, num_layers=16, intermediate_size=5632, num_heads=32, num_kv_heads=4, vocab=32000),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, 7b or 1b (random bf16 weights)")
    p.add_argument("--layers", type=int, default=0, help="layers of a random model (0: the shape's own)")
    p.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--ctx", default="1,1024", help="context lengths of the rows")
    p.add_argument("--extra", default="3,5,6", help="sizes to capture besides the ladder's")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--json")
    a = p.parse_args(argv)
    import torch
    from cuda_common import replay_median_ms

    from allspark_server import Engine, HuggingFaceModel
    from allspark_server.compute.cuda.graph_capture import capture_each_size
    from allspark_server.loader.known_models import smollm2_path
    t0 = time.time()
    if a.model == "smollm2":
        path, dtype = smollm2_path(), "bfloat16"
    else:
        spec = dict(SHAPES[a.model])
        if a.layers:
            spec["num_layers"] = a.layers
        path, dtype = build_model(spec, "bfloat16"), "bfloat16"
    built = time.time() - t0
    report = {"gpu": torch.cuda.get_device_name(0), "model": a.model, "layers": a.layers or None,
              "num_speculative_tokens": a.tokens, "max_batch": a.max_batch, "build_s": round(built, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        loader = HuggingFaceModel(path, "m", user_set_data_type=dtype).load_model()
        loader.serialize(None, model_output_dir=tmp)
        engine = Engine()
        for name in ("m", "plain"):
            b = (loader.create_reference_runtime_config_builder(name, "cuda", [0], max_batch=a.max_batch)
                 .max_length(2048).kv_cache_span_size(32))
            engine.install_model((b.speculative_decoding("ngram", a.tokens) if name == "m" else b).build())
        loader.free_model()
        plain = engine._models["plain"].runner.graphs
        report["install_s"] = round(time.time() - t0 - built, 1)
        g = engine._models["m"].runner.graphs
        assert g is not None, "no decode graphs (ALLSPARK_CUDA_GRAPHS off?)"
        report["ladder"] = list(g.sizes)
        extra = [s for s in map(int, a.extra.split(",")) if s not in g.sizes and s <= g.sizes[-1]]
        with torch.inference_mode():
            extra_graphs, _ = capture_each_size(lambda n: g.model(g._inputs(n), g.kv), extra) if extra else ({}, {})
        graphs = {**{str(s): v for s, v in {**g.graphs, **extra_graphs}.items()},
                  **{f"v{s}": v for s, v in g.verify_graphs.items()}}
        order = sorted(graphs, key=lambda s: (s.startswith("v"), int(s.lstrip("v"))))
        rows = {}
        for ctx in map(int, a.ctx.split(",")):
            for pg in (g, plain):   # every row a padding row at this context
                pg.positions.fill_(ctx - 1)
                pg.slots.fill_(pg.scratch_slot + (ctx - 1) % pg.span_size)
                pg.ctx.fill_(ctx)
            g.ids.copy_(torch.randint(0, 1000, (g.ids.shape[0],), device=g.ids.device))
            times = {s: replay_median_ms(graphs[s], a.repeats) for s in order}
            plain1 = replay_median_ms(plain.graphs[1], a.repeats)
            again1 = replay_median_ms(graphs["1"], a.repeats)
            rows[ctx] = {"ms": {s: round(t, 4) for s, t in times.items()}, "ms_size1_again": round(again1, 4),
                         "over_size1": {s: round(t / times["1"], 3) for s, t in times.items()},
                         "plain_model_size1_ms": round(plain1, 4),
                         "over_plain_size1": {s: round(t / plain1, 3) for s, t in times.items()}}
            print(f"{a.model} ctx {ctx}: " + "  ".join(f"{s}:{t:.3f}ms({t / times['1']:.2f}x)"
                                                      for s, t in times.items()) + f"  1 again:{again1:.3f}",
                  flush=True)
        for pg in (g, plain):   # the padding rows' state again
            pg.positions.zero_()
            pg.slots.fill_(pg.scratch_slot)
            pg.ctx.fill_(1)
            pg.ids.zero_()
        report["by_ctx"] = rows
        v = 1 + a.tokens
        report["verify_rows"] = v
        report["verify_padded_to"] = next((s for s in g.sizes if s >= v), None)   # None: only a verify graph holds it
        report["verify_graph_over_size1"] = {ctx: r["over_size1"].get(f"v{v}") for ctx, r in rows.items()}
        report["verify_graph_over_plain_size1"] = {ctx: r["over_plain_size1"].get(f"v{v}") for ctx, r in rows.items()}
        engine.release_model("m")
        engine.release_model("plain")
    print(json.dumps(report), flush=True)
    if a.json:
        write_report(a.json, report)


if __name__ == "__main__":
    main()
