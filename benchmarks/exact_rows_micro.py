"""The race behind invariant rows (gemv_kernels._rows_dot_kernel): GEMV kernels whose rows come out bit for bit as
they would alone, for a speculative verify chunk (k + 1 rows of one sequence) at the cost of about one weight read
(exact_rows_protos.py's prototypes), against the FMA GEMV at one row and in alone-rows mode (a program per row),
and cuBLAS; weight bytes per call over copies past L2, CUDA-graph replays. Run on a GPU machine:

    python benchmarks/exact_rows_micro.py [--out PATH]        # per 7B shape: FMA and tensor-core tiles, 1 and 5 rows
    python benchmarks/exact_rows_micro.py --pdl-round [--tma-only]   # PDL and TMA variants, 8 layers in sequence
    python benchmarks/exact_rows_micro.py --small PATH        # SmolLM2's 30 layers in sequence, its LM head
    python benchmarks/exact_rows_micro.py --production PATH   # gemv_kernels' own launches in invariant rows by tile

--smoke: two small shapes under Triton's interpreter without a GPU (the script runs; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from cuda_common import copies_past_l2, device, per_call_us  # first: it sets Triton's interpreter without a GPU
from exact_rows_protos import dot_pdl, dot_rows, dot_tma, fma_rows

from allspark_server.compute import row_mode
from allspark_server.compute.cuda import gemv_kernels as gk

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}


def alone_gemv(x, w):
    with row_mode.alone_rows():
        return gk.gemv(x, w)


FMA_CONFIGS = [(2, 2048, 8), (2, 4096, 8), (1, 2048, 4), (1, 4096, 8), (2, 2048, 16), (4, 1024, 8), (1, 1024, 4)]
DOT_CONFIGS = [(32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 6), (32, 512, 4, 3), (16, 256, 4, 4),
               (128, 128, 8, 4), (16, 512, 4, 4), (32, 128, 4, 8)]


def exact_rows(fn, x) -> bool:
    y = fn(x)
    return all(torch.equal(y[i:i + 1], fn(x[i:i + 1])) for i in range(x.shape[0]))


def race(row: dict, name: str, cfgs, kernel, x, ws, err=None, *extra) -> None:
    """row[name_cfg_m]: microseconds of kernel(x, w, *cfg, *extra) over the copies ws; with err its error, and
    for several rows whether each equals itself alone; a config that does not compile: the error."""
    m = x.shape[0]
    for cfg in cfgs:
        key = f"{name}_{'_'.join(map(str, cfg))}_{m}"
        try:
            row[key] = per_call_us(lambda w: kernel(x, w, *cfg, *extra), ws)
            if err is not None:
                row[key + "_err"] = err(kernel(x, ws[0], *cfg, *extra))
            if m > 1:
                row[key + "_exact"] = exact_rows(lambda t: kernel(t, ws[0], *cfg, *extra), x)
        except Exception as e:
            row[key] = repr(e)[:200]


TMA_CONFIGS = [(64, 128, 4, 6), (64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (64, 64, 4, 8),
               (32, 128, 4, 6), (128, 64, 4, 8), (64, 256, 4, 3)]
PDL_CONFIGS = [(64, 128, 4, 6), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4), (32, 128, 2, 6), (32, 256, 2, 4),
               (16, 256, 1, 4), (16, 128, 1, 6), (64, 64, 4, 8), (128, 64, 8, 6), (64, 128, 8, 6), (128, 128, 4, 4)]


def chain(gemv, layers, x):
    """A decode layer's four GEMVs in sequence, each reading the one before (8 layers)."""
    h = x
    for wqkv, wo, wgu, wd in layers:
        q = gemv(h, wqkv)[:, :4096]
        h = gemv(q, wo)
        g = gemv(h, wgu)[:, :11008]
        h = gemv(g, wd)
    return h


def pdl_round(args):
    from cuda_common import time_us
    result = {}
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16) for _ in range(copies_past_l2(n * k * 2))]
        row = result[name] = {}
        for m in args.rows:
            x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
            row[f"prod_{m}"] = per_call_us(lambda w: gk.gemv(x, w), ws) if m <= 2 else None
            row[f"prod_alone_{m}"] = per_call_us(lambda w: alone_gemv(x, w), ws)
            race(row, "tma", TMA_CONFIGS, dot_tma, x, ws)
            race(row, "pdl", PDL_CONFIGS[:2] if args.tma_only else PDL_CONFIGS, dot_pdl, x, ws)
        print(name, json.dumps(row), flush=True)
        ws = None
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [tuple((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                    for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))) for _ in range(8)]
    ch = result["chain8"] = {}
    for m in args.rows:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        if m <= 2:
            ch[f"prod_{m}"] = time_us(lambda: chain(gk.gemv, layers, x))
        ch[f"prod_alone_{m}"] = time_us(lambda: chain(alone_gemv, layers, x))
        for cfg in TMA_CONFIGS[:6]:
            ch[f"tma_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                lambda: chain(lambda a, w: dot_tma(a, w, *cfg), layers, x))
        for cfg in PDL_CONFIGS[:1]:
            ch[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                lambda: chain(lambda a, w: dot_pdl(a, w, *cfg), layers, x))
    print("chain8", json.dumps(ch), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="exact_rows_micro.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--pdl-round", action="store_true")
    ap.add_argument("--tma-only", action="store_true")
    args = ap.parse_args(argv)
    if args.pdl_round:
        return pdl_round(args)
    shapes = {"qkv": (64, 256), "down": (32, 320)} if args.smoke else SHAPES
    fma_cfgs = FMA_CONFIGS[:2] if args.smoke else FMA_CONFIGS
    dot_cfgs = [(16, 64, 4, 2)] if args.smoke else DOT_CONFIGS
    result = {}
    for name, (n, k) in shapes.items():
        ws = ([(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16)] if args.smoke else
              [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16)
               for _ in range(copies_past_l2(n * k * 2))])
        row = result[name] = {"gb": n * k * 2 / 1e9}
        for m in args.rows:
            x = torch.randn(m, k, device=device(), dtype=torch.bfloat16)
            ref = F.linear(x.double(), ws[0].double())
            def err(y):
                return ((y.double() - ref).abs().max() / ref.abs().max()).item()
            row[f"cublas_{m}"] = per_call_us(lambda w: F.linear(x, w), ws)
            row[f"prod_{m}"] = per_call_us(lambda w: gk.gemv(x, w), ws) if m <= 2 else None
            row[f"prod_alone_{m}"] = per_call_us(lambda w: alone_gemv(x, w), ws)
            race(row, "fma", fma_cfgs, fma_rows, x, ws, err)
            race(row, "dot", dot_cfgs, dot_rows, x, ws, err, True)
            race(row, "dot_noev", dot_cfgs, dot_rows, x, ws, err, False)
        print(name, json.dumps(row), flush=True)
        ws = None
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__" and not {"--small", "--production"} & set(__import__("sys").argv):
    main()


SMALL_CONFIGS = [(32, 128, 2, 6), (16, 64, 1, 4), (16, 128, 1, 4), (16, 256, 1, 2), (16, 512, 2, 2), (32, 256, 2, 3),
                 (32, 512, 2, 2), (32, 1024, 4, 1), (16, 1024, 4, 1), (64, 128, 4, 6), (32, 64, 2, 4), (16, 128, 2, 3),
                 (16, 256, 2, 2), (32, 256, 4, 2)]


def small_chain(gemv, layers, x):
    """SmolLM2's four GEMVs a layer in sequence, each reading the one before (30 layers)."""
    h = x
    for wqkv, wo, wgu, wd in layers:
        h = gemv(gemv(h, wqkv)[:, :576], wo)
        h = gemv(gemv(h, wgu)[:, :1536], wd)
    return h


def small_round(out):
    from cuda_common import time_us
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [tuple((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))) for _ in range(30)]
    res = {}
    for m in (1, 5):
        x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
        if m == 1:
            res["prod_1"] = time_us(lambda: small_chain(gk.gemv, layers, x))
        res[f"prod_alone_{m}"] = time_us(lambda: small_chain(alone_gemv, layers, x))
        for cfg in SMALL_CONFIGS:
            try:
                res[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = time_us(
                    lambda: small_chain(lambda a, w: dot_pdl(a, w, *cfg), layers, x))
            except Exception as e:
                res[f"pdl_{'_'.join(map(str, cfg))}_{m}"] = repr(e)[:200]
    w = (torch.randn(49152, 576, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    res["lm_prod_1"] = time_us(lambda: gk.gemv(x, w))
    for cfg in SMALL_CONFIGS:
        try:
            res[f"lm_pdl_{'_'.join(map(str, cfg))}_1"] = time_us(lambda: dot_pdl(x, w, *cfg))
        except Exception as e:
            res[f"lm_pdl_{'_'.join(map(str, cfg))}_1"] = repr(e)[:200]
    print(json.dumps(res))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


PROD_CONFIGS = [(32, 128, 2, 6), (64, 128, 4, 6), (64, 128, 4, 4), (32, 128, 2, 4), (64, 64, 4, 8), (128, 128, 8, 4),
                (32, 256, 2, 4), (64, 128, 8, 6), (32, 64, 2, 8)]


def production_round(out):
    """gemv_kernels' own launches in invariant-rows mode, by config, against the plain GEMV: the 7B shapes and
    the MLP's gate_up with silu·mul."""
    from allspark_server.compute.row_mode import invariant_rows
    res = {}
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k, device=device()) * 0.02).to(torch.bfloat16) for _ in range(copies_past_l2(n * k * 2))]
        x = torch.randn(1, k, device=device(), dtype=torch.bfloat16)
        fns = {"": gk.gemv} if name != "gate_up" else {"": gk.gemv, "silu_": gk.gemv_silu_mul}
        for tag, fn in fns.items():
            res[f"{tag}{name}_plain"] = per_call_us(lambda w: fn(x, w), ws)
            for cfg in PROD_CONFIGS:
                c = gk.GemvConfig(*cfg)
                try:
                    with invariant_rows():
                        res[f"{tag}{name}_{'_'.join(map(str, cfg))}"] = per_call_us(lambda w: fn(x, w, config=c), ws)
                except Exception as e:
                    res[f"{tag}{name}_{'_'.join(map(str, cfg))}"] = repr(e)[:120]
        print(name, {k: v if isinstance(v, str) else round(v, 2) for k, v in res.items() if name in k}, flush=True)
        ws = None
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__" and len(__import__("sys").argv) > 1 and __import__("sys").argv[1] == "--small":
    small_round(__import__("sys").argv[2])
if __name__ == "__main__" and len(__import__("sys").argv) > 1 and __import__("sys").argv[1] == "--production":
    production_round(__import__("sys").argv[2])
