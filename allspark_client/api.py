"""EngineAPI: what Engine and ClientEngine share verbatim — error reporting and the text/ids
conveniences built on `start_request`. Each subclass implements the rest of the API (DESIGN §3).
Torch-free.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsStatus, RequestHandle

log = logging.getLogger("allspark")
StartResult = tuple[AsStatus, Optional[RequestHandle], Optional[ResultQueue]]


class EngineAPI:
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

    def start_request_ids(self, name: str, model, input_ids, generate_config=None) -> StartResult:
        return self.start_request(name, {"input_ids": input_ids}, generate_config)

    def start_request_text(self, name: str, model, text: str, generate_config=None) -> StartResult:
        """Tokenize `text` with `model`'s tokenizer (a HuggingFaceModel, or any tokenizer) and start it."""
        if not isinstance(text, str):
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, f"text must be a str, got {type(text).__name__}"), None, None
        tokenizer = model.get_tokenizer() if hasattr(model, "get_tokenizer") else model
        return self.start_request(name, {"input_ids": tokenizer.encode(text)}, generate_config)
