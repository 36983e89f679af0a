"""Checkpoint surgery the architecture converters share: splitting fused projections into the decoder's parts
and reordering the rotating dims of q/k rows into the decoder's rotary layout.

The decoder rotates pair i of a head at dims (i, i + head_dim/2) (HF Llama's rotate_half) and leaves dims whose
cos/sin are 1/0 unchanged (layers/rotary.py). A checkpoint that rotates interleaved pairs (2i, 2i+1) (GLM,
ChatGLM), or only its first `rotary_dim` dims, gets its q and k output rows permuted once at load; scores are
q.k sums over a head's dims, so the same permutation of q and k leaves them unchanged.
"""
from __future__ import annotations

import torch

from allspark_server.models.args import ModelArgs


def split_rows(t: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
    """A fused projection's weight [sum(sizes), in] or bias [sum(sizes)] -> its parts."""
    if t.shape[0] != sum(sizes):
        raise ValueError(f"{what} has {t.shape[0]} rows; the config implies {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))})")
    return list(t.split(sizes, dim=0))


def qkv_sizes(args: ModelArgs) -> list[int]:
    d = args.head_dim
    return [args.num_heads * d, args.num_kv_heads * d, args.num_kv_heads * d]


def to_rotary_layout(t: torch.Tensor, args: ModelArgs, interleaved: bool) -> torch.Tensor:
    """q or k rows (weight or bias) of a checkpoint whose rotating pairs are interleaved, or whose rotary covers
    only the first args.rotary_dim dims, in the decoder's layout."""
    return reorder_rotary_rows(t, args.head_dim, rotary_dim_order(args.head_dim, args.num_rotary_dims, interleaved))


def split_qkv(t: torch.Tensor, args: ModelArgs, name: str, prefix: str, suffix: str,
              interleaved: "bool | None" = None) -> tuple:
    """A fused q|k|v weight or bias -> the decoder's `{prefix}self_attn.{q,k,v}_proj.{suffix}`; with `interleaved`
    (not None) q and k are brought into the decoder's rotary layout (to_rotary_layout)."""
    q, k, v = split_rows(t, qkv_sizes(args), name)
    if interleaved is not None:
        q, k = to_rotary_layout(q, args, interleaved), to_rotary_layout(k, args, interleaved)
    return tuple((f"{prefix}self_attn.{part}_proj.{suffix}", x) for part, x in zip("qkv", (q, k, v)))


def split_gate_up(t: torch.Tensor, args: ModelArgs, name: str, prefix: str, suffix: str) -> tuple:
    """A fused gate|up weight or bias (gate rows first) -> `{prefix}mlp.{gate,up}_proj.{suffix}`."""
    gate, up = split_rows(t, [args.intermediate_size] * 2, name)
    return (f"{prefix}mlp.gate_proj.{suffix}", gate), (f"{prefix}mlp.up_proj.{suffix}", up)


def rotary_dim_order(head_dim: int, rotary_dim: int, interleaved: bool) -> list[int]:
    """order[new] = old: the checkpoint dim each of our dims takes. Rotating pair i of the checkpoint (dims
    (2i, 2i+1) interleaved, else (i, i + rotary_dim/2)) goes to (i, i + head_dim/2); the dims that do not rotate
    fill the rest in order."""
    half, pairs = head_dim // 2, rotary_dim // 2
    first = [2 * i for i in range(pairs)] if interleaved else list(range(pairs))
    second = [2 * i + 1 for i in range(pairs)] if interleaved else list(range(pairs, rotary_dim))
    rest = list(range(rotary_dim, head_dim))
    fill = half - pairs
    return first + rest[:fill] + second + rest[fill:]


def reorder_rotary_rows(t: torch.Tensor, head_dim: int, order: list[int]) -> torch.Tensor:
    """q or k rows [heads * head_dim, ...] -> each head's dims in `order`."""
    heads = t.shape[0] // head_dim
    index = torch.tensor(order)
    return t.reshape(heads, head_dim, *t.shape[1:])[:, index].reshape(t.shape).contiguous()


def layer_index(name: str, prefix: str) -> tuple[int, str]:
    """'prefix.<i>.rest' -> (i, rest)."""
    i, _, rest = name[len(prefix):].partition(".")
    return int(i), rest
