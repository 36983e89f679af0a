"""Embedding calls' arguments, checked the same way by Engine and ClientEngine (torch-free).

`embed(model_name, input_ids_list, pooling, normalize)` takes token-id lists and returns one float32 vector per
input: the decoder's final-norm hidden state of the last token ("last") or the mean over all tokens ("mean"),
L2-normalized when asked.
"""
from __future__ import annotations

from typing import Any, Optional

from allspark_client.generation_config import parse_input_ids
from allspark_client.validation import ConfigError, _check

POOLINGS = ("last", "mean")
MAX_EMBED_INPUTS = 2048     # inputs in one call (OpenAI's bound on an embeddings request's array)


def parse_embed_args(input_ids_list: Any, pooling: Any, normalize: Any, vocab_size: Optional[int] = None
                     ) -> list[list[int]]:
    """The inputs as lists of ids; ConfigError naming the bad argument otherwise."""
    _check(pooling in POOLINGS, f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r:.80}")
    _check(isinstance(normalize, bool), f"normalize must be a bool, got {normalize!r:.80}")
    if hasattr(input_ids_list, "tolist") and not isinstance(input_ids_list, list):
        input_ids_list = input_ids_list.tolist()
    _check(isinstance(input_ids_list, (list, tuple)) and len(input_ids_list) > 0,
           f"input_ids_list must be a non-empty list of token-id lists, got {type(input_ids_list).__name__}")
    _check(len(input_ids_list) <= MAX_EMBED_INPUTS,
           f"input_ids_list holds {len(input_ids_list)} inputs, more than {MAX_EMBED_INPUTS}")
    out = []
    for i, ids in enumerate(input_ids_list):
        try:
            out.append(parse_input_ids(ids, vocab_size))
        except ConfigError as e:
            raise ConfigError(f"input_ids_list[{i}]: {e}", e.status) from None
    return out
