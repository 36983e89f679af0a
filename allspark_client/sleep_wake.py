"""ClientEngine's sleep and wake of a pool's model (DashInfer's unload_device_mem / load_device_mem): a mixin that
sends them to the pool, where every rank frees or restores its shard (allspark_server/engine/sleep.py has
what they do). Both return None and raise AsException with the pool's status and reason, as Engine's do.
Torch-free.
"""
from __future__ import annotations

from typing import Optional

from allspark_client._proto import allspark_pb2 as pb
from allspark_client.types import AsException, AsStatus


class ClientDeviceMemory:
    """ClientEngine provides _rpc and _stub."""

    def unload_device_mem(self, name: str, wake_from: Optional[str] = "auto") -> None:
        """As Engine.unload_device_mem, on every rank of the pool: `wake_from` "auto", "host" (GPU ranks) or
        "files"."""
        self._device_mem(self._stub.UnloadDeviceMem, pb.DeviceMemRequest(model_name=name, wake_from=wake_from or ""))

    def load_device_mem(self, name: str) -> None:
        """As Engine.load_device_mem, on every rank of the pool."""
        self._device_mem(self._stub.LoadDeviceMem, pb.ModelRef(model_name=name))

    def _device_mem(self, method, request) -> None:
        reply = self._rpc(method, request)     # a closed client: INVALID_CALL_ERROR; a lost pool: PoolUnavailable
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
