"""Embeddings, ClientEngine's side: `embed` over the pool's Embed RPC (a mixin; Engine's is
allspark_server/engine/embed_api.py). The arguments are checked here first, with Engine's rules and messages."""
from __future__ import annotations

from typing import Any

from allspark_client import wire
from allspark_client._proto import allspark_pb2 as pb
from allspark_client.embed_args import parse_embed_args
from allspark_client.types import AsException, AsStatus
from allspark_client.validation import ConfigError


class ClientEmbed:
    """ClientEngine's embed (it provides _rpc, _stub, _closed and _closed_reason)."""

    def embed(self, model_name: str, input_ids_list: Any, pooling: str = "last", normalize: bool = False) -> list:
        """As Engine.embed: one numpy float32 vector per input (final-norm hidden states, pooled "last" or "mean",
        L2-normalized when `normalize`); AsException with the pool's status and reason otherwise."""
        if self._closed:
            raise AsException(AsStatus.ALLSPARK_INVALID_CALL_ERROR, self._closed_reason)
        try:
            inputs = parse_embed_args(input_ids_list, pooling, normalize)
        except ConfigError as e:
            raise AsException(e.status, str(e)) from None
        reply = self._rpc(self._stub.Embed, pb.EmbedRequest(model_name=model_name, pooling=pooling,
                                                            normalize=normalize,
                                                            inputs=[pb.TokenIds(ids=ids) for ids in inputs]))
        if reply.status != 0:
            raise AsException(AsStatus(reply.status), reply.message)
        return wire.embeddings_from_bytes(reply.dim, reply.data)
