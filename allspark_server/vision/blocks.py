"""The vision transformer's parts: norms, MLPs, 2-D rotary attention over segments, a block and the patch merger.

Qwen2-VL blocks: LayerNorm, an MLP fc1 -> activation (quick GELU) -> fc2. Qwen2.5-VL blocks: RMSNorm (fp32, cast
back, then the weight), a SwiGLU MLP (down(act(gate(x)) * up(x)), with biases). Attention is bidirectional inside
each segment of the sequence (a frame, or a window) and never across; segments of one length run as one batched
SDPA call. The rotary turns each head's first half with the patch row and its second with the column
(`rotary_tables`), in fp32 like transformers."""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from allspark_server.vision.tower_config import VisionConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "silu": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} is not supported (known: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class Norm(nn.Module):
    """LayerNorm (with bias) or RMSNorm (`rms`), eps from the config."""

    def __init__(self, dim: int, rms: bool, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.rms, self.eps = rms, eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = None if rms else nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rms:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _linear(n_in: int, n_out: int, dtype, device, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype, device=None):
        super().__init__()
        self.act = activation(cfg.hidden_act)
        self.gated = cfg.family == "qwen2_5_vl"
        if self.gated:
            self.gate_proj = _linear(cfg.dim, cfg.mlp_dim, dtype, device)
            self.up_proj = _linear(cfg.dim, cfg.mlp_dim, dtype, device)
            self.down_proj = _linear(cfg.mlp_dim, cfg.dim, dtype, device)
        else:
            self.fc1 = _linear(cfg.dim, cfg.mlp_dim, dtype, device)
            self.fc2 = _linear(cfg.mlp_dim, cfg.dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim] fp32 for patches at `positions` [N, 2] (row, column): head_dim / 4 frequencies
    turn with the row, as many with the column, and the pair is repeated for rotate-half's two halves."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float, device=positions.device)
                                / (2 * quarter)))
    angles = (positions[..., None].float() * inv_freq).reshape(positions.shape[0], 2 * quarter)   # [N, rows|cols]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [N, heads, head_dim] by cos/sin [N, head_dim], in fp32, cast back."""
    xf = x.float()
    half = xf.shape[-1] // 2
    turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Bidirectional attention of q, k, v [N, heads, head_dim] inside each segment [bounds[i], bounds[i+1])."""
    n, heads, dim = q.shape
    if len(bounds) == 2:
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return o.transpose(0, 1)
    starts = defaultdict(list)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            starts[e - s].append(s)
    out = torch.empty_like(q)
    for length, first in starts.items():
        idx = (torch.tensor(first, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        qs, ks, vs = (t[idx].view(len(first), length, heads, dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[idx] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype, device=None):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = _linear(cfg.dim, 3 * cfg.dim, dtype, device)
        self.proj = _linear(cfg.dim, cfg.dim, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, *rope), rotate(k, *rope)
        return self.proj(segment_attention(q, k, v, bounds).reshape(n, -1))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype, device=None):
        super().__init__()
        rms = cfg.family == "qwen2_5_vl"
        self.norm1 = Norm(cfg.dim, rms, cfg.eps, dtype, device)
        self.norm2 = Norm(cfg.dim, rms, cfg.eps, dtype, device)
        self.attn = Attention(cfg, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches (consecutive rows) -> one language-model token: norm, concatenate,
    Linear -> GELU -> Linear to the language model's width."""

    def __init__(self, cfg: VisionConfig, dtype, device=None):
        super().__init__()
        self.width = cfg.dim * cfg.merge_unit
        self.ln_q = Norm(cfg.dim, cfg.family == "qwen2_5_vl", cfg.eps, dtype, device)
        self.fc1 = _linear(self.width, self.width, dtype, device)
        self.fc2 = _linear(self.width, cfg.out_dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).reshape(-1, self.width))))
