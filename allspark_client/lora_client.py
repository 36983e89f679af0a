"""ClientEngine's LoRA adapters (DashInfer's load_lora / unload_lora, and list_loras): a mixin that sends them to the
pool, where every rank loads or drops its shard of the adapter (docs/api.md, "LoRA adapters"). The statuses and
reasons are the Engine's (get_last_error); list_loras raises AsException as Engine's does. Torch-free.
"""
from __future__ import annotations

import os
from typing import Optional

from allspark_client._proto import allspark_pb2 as pb
from allspark_client.types import AsException, AsStatus


def _lora_args(call: str, model_name, lora_name) -> Optional[str]:
    """What is wrong with a LoRA call's names before they can travel as strings (the pool checks the rest)."""
    if not isinstance(model_name, str):
        return f"{call}: model_name must be a string, got {type(model_name).__name__}"
    if not isinstance(lora_name, str) or not lora_name:
        return f"{call}: lora_name must be a non-empty string, got {lora_name!r:.80}"
    return None


class ClientLora:
    """ClientEngine provides _rpc, _stub, _status, _fail, _closed and _closed_reason."""

    def load_lora(self, model_name: str, lora_name: str, path: Optional[str | os.PathLike] = None) -> AsStatus:
        """As Engine.load_lora, on every rank of the pool. `path` (an .aslora file or a PEFT folder) is read on the
        pool's hosts; a relative one is taken from this process's working directory. None: the pool's rule,
        `<the model file's directory>/<lora_name>.aslora`."""
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, self._closed_reason)
        bad = _lora_args("load_lora", model_name, lora_name)
        if bad is None and path is not None and not (isinstance(path, (str, os.PathLike)) and str(path)):
            bad = f"load_lora: path must be a path (an .aslora file or a PEFT folder) or None, got {path!r:.80}"
        if bad is not None:
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, bad)
        request = pb.LoraRequest(model_name=model_name, lora_name=lora_name)
        if path is not None:
            request.path = os.path.abspath(os.fspath(path))
        return self._status(self._rpc(self._stub.LoadLora, request))

    def unload_lora(self, model_name: str, lora_name: str) -> AsStatus:
        """As Engine.unload_lora: LORA_NOT_FOUND when not loaded, LORA_IN_USE while a request runs with it."""
        if self._closed:
            return self._fail(AsStatus.ALLSPARK_INVALID_CALL_ERROR, self._closed_reason)
        bad = _lora_args("unload_lora", model_name, lora_name)
        if bad is not None:
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, bad)
        return self._status(self._rpc(self._stub.UnloadLora, pb.LoraRequest(model_name=model_name,
                                                                            lora_name=lora_name)))

    def list_loras(self, model_name: str) -> list[str]:
        """The names of the model's loaded adapters, sorted; AsException as Engine raises it (an unknown model)."""
        if self._closed:
            raise AsException(AsStatus.ALLSPARK_INVALID_CALL_ERROR, self._closed_reason)
        if not isinstance(model_name, str):
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR,
                              f"list_loras: model_name must be a string, got {type(model_name).__name__}")
        reply = self._rpc(self._stub.ListLoras, pb.ModelRef(model_name=model_name))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return list(reply.lora_names)
