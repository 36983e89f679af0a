"""The HTTP server's engine: an in-process Engine or a ClientEngine (an existing pool, or one it spawns), the
model's tokenizer and limits, and a small thread pool for the engine's blocking calls.

The server is a client of the public API like any user (docs/architecture.md): it serializes the HF folder once into a
cache dir, installs and starts the model (and loads --lora-modules), then only calls start_request / release_request /
get_as_engine_stat / get_model_info, and load_lora / unload_lora / list_loras for the adapters. Those calls can block
(a gRPC round trip, a step of the engine thread), so they run on `executor` (a few threads, shared by all requests:
control calls are short; streams are read by stream.QueueReader, not here). Owns no engine state but the names of the
loaded adapters as last seen (`loras`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from allspark_client.types import AsException, AsStatus
from allspark_server.http.chat_images import ChatImages
from allspark_server.http.chat_template import template_source

log = logging.getLogger("allspark.http")
CONTROL_THREADS = 8
_DEFAULT_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")   # from the model's generation_config.json


@dataclass
class BackendOptions:
    model: str                          # HF folder (weights to serialize, tokenizer, chat template)
    served_model_name: Optional[str] = None
    cache_dir: Optional[str] = None
    pool: Optional[str] = None          # address of a running pool
    ranks: Optional[int] = None         # spawn a pool of this many ranks
    dtype: Optional[str] = None
    max_batch: int = 32
    max_length: Optional[int] = None
    threads: Optional[int] = None       # in-process Engine; None: all cores but one (left to the HTTP loop)
    speculative: Optional[tuple] = None  # (method, draft model path, num_speculative_tokens): cli.speculative_spec
    speculative_max_batch: int = 0      # 0: auto
    speculative_rows: str = "auto"      # GPU verify rows: auto, alone or invariant (docs/speculative.md)
    draft_dtype: str = ""               # the draft's dtype and InstantQuant copy ("": as its files are)
    draft_quantize: str = ""
    lora_modules: tuple = ()            # (name, path) of the LoRA adapters loaded at start
    max_loras: Optional[int] = None     # lora_max_num (None: the runtime config's default)
    max_lora_rank: Optional[int] = None  # lora_max_rank (None: the default)


class Backend:
    images = None         # http/chat_images.py's ChatImages of a vision-language model (set by the builder)

    def __init__(self, engine, name: str, tokenizer, engine_max_length: int, eos_token_ids: list[int],
                 gen_defaults: dict, owns_engine: bool = True, template_source: str = "the model's chat template"):
        self.engine, self.name, self.tokenizer = engine, name, tokenizer
        self.template_source = template_source          # where the chat template comes from, as errors name it
        self.engine_max_length, self.eos_token_ids, self.gen_defaults = engine_max_length, eos_token_ids, gen_defaults
        self.is_pool = engine.is_allspark_work_as_service()
        self._owns_engine = owns_engine
        self.executor = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="allspark-http-control")
        # the model's loaded LoRA adapters as this server last saw them: name -> the path it loaded it from (None:
        # loaded by someone else, a shared pool's other client). Replaced whole, never changed in place, so the event
        # loop reads it without a lock.
        self.loras: dict[str, Optional[str]] = {}
        self._lora_lock = threading.Lock()

    # ---- blocking calls (run them on `executor`) ---------------------------------------------
    def start_choices(self, prompt_ids: list[int], gen: dict, n: int, images: Optional[dict] = None):
        """n requests of one prompt (start_request for one; `images`: its pixel_values / image_grid_thw) ->
        (status, [(handle, queue)], error message); a pool that is gone raises PoolUnavailable."""
        inputs = {"input_ids": prompt_ids, **(images or {})}
        if n == 1:
            status, handle, queue = self.engine.start_request(self.name, inputs, gen)
            started = [(handle, queue)] if status == AsStatus.ALLSPARK_SUCCESS else []
        else:
            status, started = self.engine.start_choices(self.name, inputs, gen, n)
        return status, started, ("" if status == AsStatus.ALLSPARK_SUCCESS else self.engine.get_last_error())

    def release(self, handle) -> None:
        try:
            self.engine.release_request(self.name, handle)
        except AsException as e:
            log.warning("release_request failed: %s", e)

    def release_soon(self, handle) -> None:
        """Stop and release a request without waiting for it (any thread)."""
        try:
            self.executor.submit(self.release, handle)
        except RuntimeError:                # shutting down: the engine is closed anyway
            pass

    def stat(self):
        return self.engine.get_as_engine_stat(self.name)

    # ---- LoRA adapters (blocking, on `executor`) ------------------------------------------------
    def refresh_loras(self) -> dict[str, Optional[str]]:
        """The engine's list of loaded adapters, which becomes `loras`; raises as list_loras does."""
        names = self.engine.list_loras(self.name)
        with self._lora_lock:
            self.loras = {n: self.loras.get(n) for n in names}
            return self.loras

    def load_lora(self, lora_name: str, path: str) -> tuple[AsStatus, str]:
        """load_lora -> (status, error message); a pool that is gone raises PoolUnavailable."""
        status = self.engine.load_lora(self.name, lora_name, path)
        if status != AsStatus.ALLSPARK_SUCCESS:
            return status, self.engine.get_last_error()
        with self._lora_lock:
            self.loras = {**self.loras, lora_name: path}
        return status, ""

    def unload_lora(self, lora_name: str) -> tuple[AsStatus, str]:
        status = self.engine.unload_lora(self.name, lora_name)
        if status in (AsStatus.ALLSPARK_SUCCESS, AsStatus.ALLSPARK_LORA_NOT_FOUND):
            with self._lora_lock:
                self.loras = {n: p for n, p in self.loras.items() if n != lora_name}
        return status, ("" if status == AsStatus.ALLSPARK_SUCCESS else self.engine.get_last_error())

    def is_ready(self) -> bool:
        try:
            return bool(json.loads(self.engine.get_model_info(self.name)).get("started"))
        except Exception:
            return False

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._owns_engine:
            if self.is_pool:
                self.engine.close()         # a spawned pool is shut down; a shared one stays as it is
            else:
                self.engine.shutdown()


def engine_threads(threads: Optional[int]) -> int:
    """Compute threads of an in-process Engine. By default one core is left to the event loop (HTTP, tokenizing,
    detokenizing): the Engine's workers spin between parallel regions and would take that core from it
    (docs/performance.md, "Choices in the code", has the TPOT this cost on a 2-core VM)."""
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)) - 1)


def default_cache_dir(name: str) -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "allspark", "serve", name.replace("/", "_"))


def _stamp(loader, dtype: str) -> dict:
    """What the serialized files were made from: the source folder (or GGUF file), dtype and its files' sizes and
    mtimes."""
    files = {}
    entries = [loader.path] if os.path.isfile(loader.path) else [e.path for e in os.scandir(loader.path)]
    for path in sorted(entries):
        if os.path.isfile(path) and path.endswith((".json", ".safetensors", ".bin", ".model", ".jinja", ".gguf")):
            st = os.stat(path)
            files[os.path.basename(path)] = [st.st_size, int(st.st_mtime)]
    return {"source": os.path.abspath(loader.path), "dtype": dtype, "files": files}


def serialize_cached(loader, cache_dir: str) -> None:
    """Serialize `loader`'s model into cache_dir once; later runs reuse the files while the source is unchanged."""
    os.makedirs(cache_dir, exist_ok=True)
    stamp_path = os.path.join(cache_dir, loader.model_name.replace("/", "_") + ".source.json")
    stamp = _stamp(loader, str(loader.data_type).replace("torch.", ""))
    try:
        with open(stamp_path) as f:
            fresh = json.load(f) == stamp
    except (OSError, ValueError):
        fresh = False
    safe = loader.model_name.replace("/", "_")
    if fresh and all(os.path.isfile(os.path.join(cache_dir, safe + ext)) for ext in (".asgraph", ".asparam")):
        loader.serialize_to_path(None, cache_dir, skip_if_exists=True)
        log.info("using the serialized model in %s", cache_dir)
        return
    if os.path.exists(stamp_path):
        os.remove(stamp_path)
    log.info("serializing %s into %s", loader.path, cache_dir)
    loader.load_model().serialize_to_path(None, cache_dir).free_model()
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)


def speculative_config(builder, opts: BackendOptions):
    """The builder with opts' speculative decoding (none: as it is)."""
    if not opts.speculative:
        return builder
    method, draft_model, k = opts.speculative
    options = {"speculative_max_batch": opts.speculative_max_batch, "speculative_rows": opts.speculative_rows}
    if method == "draft":
        options.update(draft_model=draft_model, draft_dtype=opts.draft_dtype, draft_quantize=opts.draft_quantize)
    return builder.speculative_decoding(method, k, **options)


def lora_config(builder, opts: BackendOptions):
    """The builder with opts' LoRA limits (none given: the defaults)."""
    if opts.max_loras is not None:
        builder = builder.lora_max_num(opts.max_loras)
    if opts.max_lora_rank is not None:
        builder = builder.lora_max_rank(opts.max_lora_rank)
    return builder


def load_lora_modules(backend: Backend, modules) -> None:
    """--lora-modules: each adapter loaded before the server listens; a failure stops the start with its reason. On a
    shared pool an adapter of that name may be loaded already: it is used as it is."""
    for lora_name, path in modules:
        status, error = backend.load_lora(lora_name, path)
        if status == AsStatus.ALLSPARK_LORA_ALREADY_LOADED:
            log.warning("LoRA adapter %r is loaded already: using it as it is (not reloaded from %s)", lora_name, path)
        elif status != AsStatus.ALLSPARK_SUCCESS:
            raise AsException(status, f"--lora-modules {lora_name}={path}: {error}")
        else:
            log.info("loaded LoRA adapter %r from %s", lora_name, path)


def served_name(model: str, served_model_name: Optional[str] = None) -> str:
    """The name clients send as `model`: --served-model-name, else the folder's (or GGUF file's) name."""
    return served_model_name or os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


def open_backend(opts: BackendOptions) -> Backend:
    """Serialize (once), connect or start the engine, install and start the model; blocks until it serves."""
    from allspark_server import Engine, HuggingFaceModel, TargetDevice
    name = served_name(opts.model, opts.served_model_name)
    loader = HuggingFaceModel(opts.model, name, user_set_data_type=opts.dtype)
    serialize_cached(loader, opts.cache_dir or default_cache_dir(name))
    tokenizer = loader.get_tokenizer()
    if opts.pool or opts.ranks:
        from allspark_client import ClientEngine
        engine = ClientEngine(opts.pool) if opts.pool else ClientEngine(ranks=opts.ranks)
        owns = not opts.pool
    else:
        engine, owns = Engine(), True
    backend = None
    try:
        try:
            info = json.loads(engine.get_model_info(name))       # a shared pool may serve it already
        except AsException:
            info = None
        if info is None:
            threads = engine_threads(opts.threads) if not engine.is_allspark_work_as_service() else 0
            builder = (loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0],
                                                                      max_batch=opts.max_batch)
                       .max_length(opts.max_length or loader.get_model_context_length())
                       .compute_unit(TargetDevice.CPU, [0], threads))
            cfg = lora_config(speculative_config(builder, opts), opts).build()
            engine.install_model(cfg)
            max_length = cfg.engine_max_length
        else:
            log.info("the pool already has model %r installed: using it as it is", name)
            if opts.speculative:
                log.warning("--speculative is ignored: the pool's model %r keeps its own config", name)
            if opts.max_loras is not None or opts.max_lora_rank is not None:
                log.warning("--max-loras / --max-lora-rank are ignored: the pool's model %r keeps its own config",
                            name)
            max_length = info["engine_max_length"]
        if engine.start_model(name) != AsStatus.ALLSPARK_SUCCESS:
            raise AsException(AsStatus.ALLSPARK_RUNTIME_ERROR, f"start_model: {engine.get_last_error()}")
        defaults = {k: loader.hf_generation_config[k] for k in _DEFAULT_KEYS if k in loader.hf_generation_config}
        backend = Backend(engine, name, tokenizer, max_length, loader.eos_token_ids(), defaults, owns_engine=owns,
                          template_source=template_source(opts.model))
        backend.images = ChatImages.for_model(opts.model)     # None unless a vision-language folder
        if info is not None:
            backend.refresh_loras()                  # a shared pool's model may have adapters loaded already
        load_lora_modules(backend, opts.lora_modules)
    except BaseException:
        if backend is not None:
            backend.executor.shutdown(wait=False)
        if owns:
            engine.close() if engine.is_allspark_work_as_service() else engine.shutdown()
        raise
    return backend
