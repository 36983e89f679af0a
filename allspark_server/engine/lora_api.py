"""LoRA adapters, Engine's side (DashInfer's load_lora / unload_lora, and list_loras): a mixin.

Rank 0 keeps, per model, which adapter sits in which slot of the runners (core/adapter_table.py); the runners hold
the tensors (runner/adapters.py). Loading and unloading run on the engine thread between steps, as a collective
every rank takes part in, so requests of other adapters and of the base model go on around them. A request names
its adapter with the generation config's `lora_name`; it is resolved to a slot when the request is accepted, and an
adapter that a live request uses cannot be unloaded (ALLSPARK_LORA_IN_USE). Each load gets a new identity in the
prefix cache's keys, so K/V computed under an adapter are never reused under another (or a reloaded one).
"""
from __future__ import annotations

import itertools
import os
from typing import Optional

from allspark_client.types import AsException, AsStatus
from allspark_server.core.adapter_table import LoadedAdapter
from allspark_server.core.messages import LoraMsg
from allspark_server.runner import adapters

_load_ids = itertools.count(1)
STATUS_OF = {adapters.MISSING: AsStatus.ALLSPARK_LORA_NOT_FOUND,
             adapters.TOO_LARGE: AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR,
             adapters.BAD: AsStatus.ALLSPARK_PARAM_ERROR}


class LoraAPI:
    """Engine's load_lora / unload_lora / list_loras (it provides _lock, _model, _engine, _comm and _fail)."""

    def _served(self, name: str):
        """The installed model, or AsException with _model's status and reason (not installed, shut down)."""
        try:
            return self._model(name)
        except Exception as e:   # RequestError
            raise AsException(getattr(e, "status", AsStatus.ALLSPARK_PARAM_ERROR), str(e)) from None

    def load_lora(self, name: str, lora_name: str, path: Optional[str] = None) -> AsStatus:
        """Load adapter `lora_name` into model `name`: from `path` (a PEFT folder or an .aslora file) or, as
        DashInfer does, from `<the model file's folder>/<lora_name>.aslora`."""
        if not isinstance(lora_name, str) or not lora_name or (path is not None and not isinstance(path, str)):
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, f"load_lora takes an adapter name and optionally a path, "
                                                             f"got {lora_name!r}, {path!r}")
        with self._lock:
            try:
                model = self._served(name)
            except AsException as e:
                return self._fail(e.status, str(e))
            table = model.adapters
            where = path or os.path.join(os.path.dirname(os.path.abspath(model.cfg.model_path)), f"{lora_name}.aslora")
            if lora_name in table.loaded:
                return self._fail(AsStatus.ALLSPARK_LORA_ALREADY_LOADED,
                                  f"LoRA adapter {lora_name!r} is already loaded into model {name!r}")
            if not os.path.exists(where):
                return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND, f"LoRA adapter {lora_name!r}: no file or folder "
                                                                    f"at {where}")
            if table.num_slots == 0:
                return self._fail(AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR,
                                  f"model {name!r} takes no LoRA adapters: its lora_max_num is 0")
            slot = table.free_slot()
            if slot is None:
                return self._fail(AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR,
                                  f"model {name!r} has {len(table.loaded)} LoRA adapters loaded, its lora_max_num "
                                  f"is {table.num_slots}: unload one first")
            msg = LoraMsg(name, slot, where, lora_name)

            def load():
                self._comm.bcast(msg)
                return adapters.apply(model.runner, msg, self._comm)

            failed = self._engine.call(load)
            if failed is not None:
                return self._fail(STATUS_OF[failed[0]], f"cannot load LoRA adapter {lora_name!r}: {failed[1]}")
            table.loaded[lora_name] = LoadedAdapter(slot, f"{lora_name}#{next(_load_ids)}")
        return AsStatus.ALLSPARK_SUCCESS

    def unload_lora(self, name: str, lora_name: str) -> AsStatus:
        """Unload adapter `lora_name` from model `name`; refused (ALLSPARK_LORA_IN_USE) while a request uses it."""
        with self._lock:
            try:
                model = self._served(name)
            except AsException as e:
                return self._fail(e.status, str(e))
            adapter = model.adapters.loaded.get(lora_name) if isinstance(lora_name, str) else None
            if adapter is None:
                return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND,
                                  f"LoRA adapter {lora_name!r} is not loaded into model {name!r}")
            adapter.unloading = True          # start_request refuses it from now on (under the same lock)

            def unload():
                users = model.scheduler.requests_of_adapter(adapter.slot)
                if users:
                    return users
                msg = LoraMsg(name, adapter.slot)
                self._comm.bcast(msg)
                adapters.apply(model.runner, msg, self._comm)
                return 0

            users = self._engine.call(unload)
            if users:
                adapter.unloading = False
                return self._fail(AsStatus.ALLSPARK_LORA_IN_USE, f"LoRA adapter {lora_name!r} is in use by {users} "
                                                                 f"request(s) of model {name!r}")
            del model.adapters.loaded[lora_name]
        return AsStatus.ALLSPARK_SUCCESS

    def list_loras(self, name: str) -> list[str]:
        """The names of the adapters loaded into model `name`, sorted."""
        with self._lock:
            return sorted(self._served(name).adapters.loaded)
