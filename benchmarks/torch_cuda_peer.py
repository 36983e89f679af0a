"""The plain-PyTorch GPU decode step the GPU benchmark measures the Engine against (a benchmark peer).

A Llama decoder written the way a careful PyTorch user would (gpt-fast's recipe): the HF weights with q/k/v
and gate/up concatenated, a static KV cache [layers, batch, kv heads, max length, head dim], cuBLAS GEMMs,
`scaled_dot_product_attention` over the whole static cache with a position mask, and the whole decode step
captured once as a CUDA graph and replayed. All sequences of a batch decode at the same position. It is
checked against transformers (`check_against_hf`) before anything is timed.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticWeights:
    """The HF model's weights as the peer reads them (q/k/v and gate/up concatenated), built once and shared by
    the peers of every batch size."""

    @torch.no_grad()
    def __init__(self, hf_model):
        cfg = hf_model.config
        p = {name: t.detach() for name, t in hf_model.named_parameters()}   # no autograd history anywhere
        self.dev, self.dtype = p["model.embed_tokens.weight"].device, p["model.embed_tokens.weight"].dtype
        self.L, self.H = cfg.num_hidden_layers, cfg.num_attention_heads
        self.KVH = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.eps = cfg.rms_norm_eps
        self.embed = p["model.embed_tokens.weight"]
        self.head = p.get("lm_head.weight", self.embed)
        self.final_norm = p["model.norm.weight"]
        self.layers = []
        for i in range(self.L):
            g = lambda n: p[f"model.layers.{i}.{n}.weight"]  # noqa: E731
            self.layers.append(dict(
                n1=g("input_layernorm"), n2=g("post_attention_layernorm"),
                qkv=torch.cat([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")]),
                o=g("self_attn.o_proj"), gu=torch.cat([g("mlp.gate_proj"), g("mlp.up_proj")]), down=g("mlp.down_proj")))
        self.rotary_emb = hf_model.model.rotary_emb


class StaticLlama:
    def __init__(self, weights: "StaticWeights | object", batch: int, max_len: int):
        if not isinstance(weights, StaticWeights):
            weights = StaticWeights(weights)
        self.__dict__.update({k: v for k, v in vars(weights).items() if k != "rotary_emb"})
        self.batch, self.max_len = batch, max_len
        rope = weights.rotary_emb
        pos = torch.arange(max_len, device=self.dev)[None]
        cos, sin = rope(torch.zeros(1, device=self.dev, dtype=self.dtype), pos)   # [1, max_len, D]
        self.cos, self.sin = cos[0], sin[0]
        shape = (self.L, batch, self.KVH, max_len, self.D)
        self.k_cache = torch.zeros(shape, device=self.dev, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.dev, dtype=self.dtype)
        self.ids = torch.zeros(batch, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.graph, self.logits = None, None

    def _norm(self, x, w):
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B], pos [1] (every sequence at the same position) -> fp32 logits [B, V]."""
        b, H, KVH, D = ids.shape[0], self.H, self.KVH, self.D
        x = F.embedding(ids, self.embed)                                       # [B, hidden]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [1, 1, 1, D]
        mask = (torch.arange(self.max_len, device=self.dev) <= pos)[None, None, None]   # [1, 1, 1, max_len]
        for i, w in enumerate(self.layers):
            h = self._norm(x, w["n1"])
            q, k, v = (h @ w["qkv"].T).split([H * D, KVH * D, KVH * D], -1)
            q, k, v = q.view(b, H, 1, D), k.view(b, KVH, 1, D), v.view(b, KVH, 1, D)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                               enable_gqa=H != KVH)             # [B, H, 1, D]
            x = x + o.reshape(b, H * D) @ w["o"].T
            gate, up = (self._norm(x, w["n2"]) @ w["gu"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        return (self._norm(x, self.final_norm) @ self.head.T).float()

    @torch.no_grad()
    def prefill_by_decoding(self, prompt: list[int]) -> torch.Tensor:
        """Feed a prompt (same for every sequence) one token at a time, eagerly; returns the last logits."""
        for t, tok in enumerate(prompt):
            self.ids.fill_(tok)
            self.pos.fill_(t)
            logits = self.forward(self.ids, self.pos)
        return logits

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one decode step (reading self.ids / self.pos) as a CUDA graph."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.forward(self.ids, self.pos)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward(self.ids, self.pos)

    @torch.no_grad()
    def decode_tps(self, start: int, steps: int) -> float:
        """Greedy decode `steps` tokens per sequence from position `start` by graph replay: tokens/s of the batch."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in range(start, start + steps):
            self.pos.fill_(t)
            self.graph.replay()
            self.ids.copy_(self.logits.argmax(-1))
        torch.cuda.synchronize()
        return self.batch * steps / (time.perf_counter() - t0)


@torch.inference_mode()
def check_against_hf(hf_model, prompt: list[int]) -> float:
    """Relative error of the peer's last-position logits (fed token by token) against transformers'."""
    peer = StaticLlama(hf_model, batch=1, max_len=len(prompt) + 1)
    ours = peer.prefill_by_decoding(prompt)[0].double()
    ref = hf_model(torch.tensor([prompt], device=peer.dev)).logits[0, -1].double()
    return float((ours - ref).norm() / ref.norm())
