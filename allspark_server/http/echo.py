"""Completions' `echo`: the prompt returned before the completion, with `logprobs` its tokens' log-probabilities
(the engine's prompt_logprobs: None for the first token, as OpenAI's legacy API and vLLM answer).

Pure: from the prompt (text or ids) and the first GeneratedElements of the request; serving.py yields the result as
the run's first piece, so text_offset and streaming follow as for generated tokens.
"""
from __future__ import annotations

from typing import Optional

from allspark_server.http.responses import TokenLogprob


def echo_text(tokenizer, prompt, prompt_ids: list[int]) -> str:
    """The prompt as sent (a string), or its token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)


def echo_tokens(prompt_ids: list[int], el, with_logprobs: bool) -> list[TokenLogprob]:
    """Each prompt token with its logprob and top pairs (the first token: none); [] without logprobs."""
    lps: Optional[list] = el.prompt_logprobs if el is not None else None
    if not with_logprobs or lps is None:
        return []
    tops = el.prompt_top_logprobs or [[] for _ in lps]
    return [TokenLogprob(t, lp, list(top)) for t, lp, top in zip(prompt_ids, lps, tops)]
