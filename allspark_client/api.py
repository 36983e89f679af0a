"""EngineAPI: what Engine and ClientEngine share verbatim — error reporting, the text/ids
conveniences built on `start_request`, and `with engine:` (close() at the end). Each subclass
implements the rest of the API (docs/api.md).
Torch-free.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional, Protocol, runtime_checkable

from allspark_client.compat import DashInferCompat
from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsStatus, RequestHandle

log = logging.getLogger("allspark")
StartResult = tuple[AsStatus, Optional[RequestHandle], Optional[ResultQueue]]
MAX_CHOICES = 128                 # OpenAI's bound on `n`
_GOLDEN = 0x9E3779B97F4A7C15      # 2^64 / golden ratio: seeds of neighbouring choices land far apart
_M64 = 2**64 - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (start_choices); choice 0 keeps `seed`."""
    return (seed + index * _GOLDEN) & _M64


class EngineAPI(DashInferCompat):
    _errors: threading.local

    def get_last_error(self) -> str:
        """The message behind the last non-success status returned to the calling thread."""
        return getattr(self._errors, "message", "")

    def _fail(self, status, message: str) -> AsStatus:
        log.warning("%s: %s", AsStatus(status).name, message)
        self._errors.message = message
        return AsStatus(status)

    def start_request(self, name: str, inputs, generate_config=None) -> StartResult:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # LoRA adapters (docs/api.md, "LoRA adapters"): each engine implements them
    def load_lora(self, model_name: str, lora_name: str, path: Optional[str] = None) -> AsStatus:
        raise NotImplementedError

    def unload_lora(self, model_name: str, lora_name: str) -> AsStatus:
        raise NotImplementedError

    def list_loras(self, model_name: str) -> list[str]:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start_choices(self, name: str, inputs, generate_config=None, n: int = 1
                      ) -> tuple[AsStatus, list[tuple[RequestHandle, ResultQueue]]]:
        """`n` requests of one prompt (OpenAI's and vLLM's `n`): (status, [(handle, queue)] of each choice).

        Each choice is an ordinary request (stop, release and read it as any other). With a `seed`, choice i draws
        with `choice_seed(seed, i)` (choice 0 with `seed` itself), so the set is reproducible and the choices
        differ; without one each draws its own. With the prefix cache on (the default) the prompt's full spans are
        computed once: the other choices wait for them and take them from the cache (docs/api.md, "n choices").
        All or nothing: if one fails to start, those started are released and (its status, []) returned."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            message = f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}"
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, message), []
        raw = generate_config.build() if hasattr(generate_config, "build") else generate_config
        if raw is not None and not isinstance(raw, dict):
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"generate_config must be a dict or a builder, got {type(raw).__name__}"), []
        raw = dict(raw or {})
        started: list[tuple[RequestHandle, ResultQueue]] = []
        for i in range(n):
            config = raw if i == 0 or raw.get("seed") is None else {**raw, "seed": choice_seed(raw["seed"], i)}
            status, handle, queue = self.start_request(name, inputs, config)
            if status != AsStatus.ALLSPARK_SUCCESS:
                message = self.get_last_error()
                for h, _ in started:
                    self.release_request(name, h)
                return self._fail(status, message), []
            started.append((handle, queue))
        return AsStatus.ALLSPARK_SUCCESS, started

    def start_request_ids(self, name: str, model, input_ids, generate_config=None) -> StartResult:
        return self.start_request(name, {"input_ids": input_ids}, generate_config)

    def start_request_text(self, name: str, model, text: str, generate_config=None) -> StartResult:
        """Tokenize `text` with `model`'s tokenizer (a HuggingFaceModel, or any tokenizer) and start it."""
        if not isinstance(text, str):
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"text must be a str, got {type(text).__name__}"), None, None
        tokenizer = model.get_tokenizer() if hasattr(model, "get_tokenizer") else model
        return self.start_request(name, {"input_ids": tokenizer.encode(text)}, generate_config)


@runtime_checkable
class EngineProtocol(Protocol):
    """The public API both Engine (in process) and ClientEngine (a pool) implement (docs/api.md)."""

    def install_model(self, cfg) -> AsStatus: ...
    def start_model(self, name: str) -> AsStatus: ...
    def stop_model(self, name: str) -> AsStatus: ...
    def release_model(self, name: str) -> AsStatus: ...
    def start_request(self, name: str, inputs, generate_config=None) -> StartResult: ...
    def start_request_ids(self, name: str, model, input_ids, generate_config=None) -> StartResult: ...
    def start_choices(self, name: str, inputs, generate_config=None, n: int = 1): ...
    def start_request_text(self, name: str, model, text: str, generate_config=None) -> StartResult: ...
    def stop_request(self, name: str, handle: RequestHandle) -> AsStatus: ...
    def release_request(self, name: str, handle: RequestHandle) -> AsStatus: ...
    def sync_request(self, name: str, handle: Optional[RequestHandle] = None) -> AsStatus: ...
    def get_model_info(self, name: str) -> str: ...
    def get_as_engine_stat(self, name: str): ...
    def get_op_profile(self, name: str): ...
    def get_op_profiling_info(self, name: str) -> str: ...
    def get_rank_id(self) -> int: ...
    def get_version_full(self) -> str: ...
    def is_allspark_work_as_service(self) -> bool: ...
    def get_last_error(self) -> str: ...
    def close(self) -> None: ...
    def get_no_wait(self, name: str, queue: ResultQueue): ...
    def get_wait(self, name: str, queue: ResultQueue): ...
    def get_request_status(self, name: str, queue: ResultQueue): ...
    def get_free_frame(self, name: str) -> int: ...
    def get_file_information(self, graph_path: str, param_path: str): ...
    def unload_device_mem(self, name: str, wake_from: Optional[str] = "auto") -> None: ...
    def load_device_mem(self, name: str) -> None: ...
    def load_lora(self, model_name: str, lora_name: str, path: Optional[str] = None) -> AsStatus: ...
    def unload_lora(self, model_name: str, lora_name: str) -> AsStatus: ...
    def list_loras(self, model_name: str) -> list[str]: ...
