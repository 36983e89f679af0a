"""Conversions between allspark's public Python types and the pool's protobuf messages.

Used by both ends: ClientEngine (dicts and dataclasses -> requests, replies -> types) and the rank-0
service (requests -> what Engine takes, Engine results -> replies). Torch-free.
"""
from __future__ import annotations

import json
from dataclasses import fields

from allspark_client._proto import allspark_pb2 as pb
from allspark_client.config import AsModelConfig
from allspark_client.generation_config import GenerationConfig
from allspark_client.op_profile_report import OpProfileReport, OpTiming, RankSteps
from allspark_client.types import AsCacheMode, AsEngineStat, GeneratedElements, RequestStatInfo

PROTOCOL_VERSION = 1

_OPTIONAL_SCALARS = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "min_length", "max_length", "max_new_tokens", "seed", "logprobs", "top_logprobs", "do_sample",
                     "speculative", "prompt_logprobs")
# RuntimeConfig fields sent only when set: a pool reads an absent one as AsModelConfig's default
_OPTIONAL_RUNTIME = ("lora_max_num", "lora_max_rank", "speculative_rows")


# ---- runtime config ------------------------------------------------------------------------------
def runtime_config_to_proto(cfg: AsModelConfig) -> pb.RuntimeConfig:
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    values["cache_mode"] = int(values["cache_mode"])
    return pb.RuntimeConfig(**values)


def runtime_config_from_proto(msg: pb.RuntimeConfig) -> AsModelConfig:
    """May raise ConfigError (validated on construction, as everywhere)."""
    values = {f.name: getattr(msg, f.name) for f in fields(AsModelConfig)
              if f.name not in _OPTIONAL_RUNTIME or msg.HasField(f.name)}
    values["cache_mode"] = AsCacheMode(values["cache_mode"]) if values["cache_mode"] in \
        {m.value for m in AsCacheMode} else values["cache_mode"]
    return AsModelConfig(**values)


# ---- generation config ---------------------------------------------------------------------------
def generation_config_to_proto(raw: dict, gen: GenerationConfig) -> pb.GenerationConfig:
    """Encode the keys the user set (`raw`), with the values as validated (`gen`)."""
    msg = pb.GenerationConfig()
    for key in _OPTIONAL_SCALARS:
        if key in raw and getattr(gen, key) is not None:
            setattr(msg, key, getattr(gen, key))
    if gen.eos_token_ids is not None:
        msg.has_eos_token_id = True
        msg.eos_token_id.extend(gen.eos_token_ids)
    for words in gen.stop_words_ids:
        msg.stop_words_ids.add(ids=list(words))
    if gen.response_format is not None:
        msg.response_format_json = gen.response_format.to_json()
    if gen.lora_name:
        msg.lora_name = gen.lora_name
    for t, b in gen.logit_bias:
        msg.logit_bias[t] = b
    return msg


def generation_config_from_proto(msg: pb.GenerationConfig) -> dict:
    out = {key: getattr(msg, key) for key in _OPTIONAL_SCALARS if msg.HasField(key)}
    if msg.has_eos_token_id:
        out["eos_token_id"] = list(msg.eos_token_id)
    if msg.stop_words_ids:
        out["stop_words_ids"] = [list(w.ids) for w in msg.stop_words_ids]
    if msg.response_format_json:
        try:   # ResponseFormat.to_json's dict; parse_generation_config validates it again
            out["response_format"] = json.loads(msg.response_format_json)
        except ValueError:
            out["response_format"] = msg.response_format_json   # rejected there, naming response_format
    if msg.lora_name:
        out["lora_name"] = msg.lora_name
    if msg.logit_bias:
        out["logit_bias"] = dict(msg.logit_bias)
    return out


# ---- results -------------------------------------------------------------------------------------
def elements_to_reply(el: GeneratedElements, reply: pb.GenerateReply) -> None:
    reply.ids.extend(el.ids_from_generate)
    reply.token_logprobs.extend(el.token_logprobs_list)
    for top in el.log_probs_list:
        reply.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
    reply.prefix_cache_len = el.prefix_cache_len
    if el.prompt_logprobs is not None:
        reply.has_prompt_logprobs = True
        reply.prompt_token_logprobs.extend(el.prompt_logprobs[1:])
        for top in el.prompt_top_logprobs[1:]:
            reply.prompt_top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def elements_from_reply(reply: pb.GenerateReply) -> GeneratedElements:
    el = GeneratedElements(
        ids_from_generate=list(reply.ids),
        log_probs_list=[list(zip(t.token_ids, t.logprobs)) for t in reply.top_logprobs],
        token_logprobs_list=list(reply.token_logprobs),
        prefix_cache_len=reply.prefix_cache_len)
    if reply.has_prompt_logprobs:
        el.prompt_logprobs = [None] + list(reply.prompt_token_logprobs)
        el.prompt_top_logprobs = [[]] + [list(zip(t.token_ids, t.logprobs)) for t in reply.prompt_top_logprobs]
    return el


def embeddings_to_bytes(vectors: list) -> tuple[int, bytes]:
    """float32 vectors of one size (numpy arrays) -> (their size, their values one after another, little-endian)."""
    dim = len(vectors[0]) if vectors else 0
    return dim, b"".join(v.astype("<f4", copy=False).tobytes() for v in vectors)


def embeddings_from_bytes(dim: int, data: bytes) -> list:
    """embeddings_to_bytes' inverse: numpy float32 arrays of `dim` (numpy is imported here only: a client that
    never embeds does not need it)."""
    import numpy as np
    flat = np.frombuffer(data, dtype="<f4").astype(np.float32)
    return [flat[i:i + dim].copy() for i in range(0, len(flat), dim)] if dim else []


def stats_to_proto(stats: dict) -> pb.RequestStats:
    return pb.RequestStats(**{f.name: stats[f.name] for f in fields(RequestStatInfo)})


def stats_from_proto(msg: pb.RequestStats) -> RequestStatInfo:
    return RequestStatInfo(**{f.name: getattr(msg, f.name) for f in fields(RequestStatInfo)})


def engine_stat_to_proto(stat: AsEngineStat) -> pb.EngineStat:
    return pb.EngineStat(**stat.dict())


def engine_stat_from_proto(msg: pb.EngineStat) -> AsEngineStat:
    values = {f.name: getattr(msg, f.name) for f in fields(AsEngineStat)}
    return AsEngineStat(**{k: list(v) if k.startswith("rank_") else v for k, v in values.items()})


def op_profile_to_proto(report: OpProfileReport) -> pb.OpProfile:
    return pb.OpProfile(model_name=report.model_name, enabled=report.enabled, clock=report.clock,
                        ops=[pb.OpTiming(**{f.name: getattr(o, f.name) for f in fields(OpTiming)}) for o in report.ops],
                        steps=[pb.RankSteps(rank=s.rank, steps=s.steps, step_ms=s.step_ms) for s in report.steps])


def op_profile_from_proto(msg: pb.OpProfile) -> OpProfileReport:
    return OpProfileReport(msg.model_name, msg.enabled,
                           tuple(OpTiming(**{f.name: getattr(o, f.name) for f in fields(OpTiming)}) for o in msg.ops),
                           tuple(RankSteps(s.rank, s.steps, s.step_ms) for s in msg.steps), msg.clock)
