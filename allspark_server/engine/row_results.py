"""What rank 0 does with a step's rows besides the sampled ones (runner/row_outputs.py): keeps each live request's
prompt logprobs by position and its embedding rows by chunk, and hands the prompt logprobs over once, with the
request's first token. The served model calls these; the requests' records are its AddRequest entries."""
from __future__ import annotations

from allspark_client.types import GeneratedElements
from allspark_server.runner.row_outputs import StepRows, prompt_logprobs


def take_rows(live: dict, rows: "StepRows | None") -> None:
    """Called before the scheduler's update: a request's computed count is still its chunk's start."""
    if rows is None:
        return
    def top_k(rid: int) -> int:
        return live[rid].sampling.gen.prompt_logprobs or 0
    for rid, got in prompt_logprobs(rows, top_k).items():
        for pos, lp, top in got:
            live[rid].prompt_rows[pos] = (lp, top)
    for rid, hidden in rows.hidden.items():
        entry = live[rid]
        entry.embed.add(entry.request.num_computed_tokens, hidden)


def attach_rows(entry, el: GeneratedElements) -> None:
    """On a request's element: its prompt logprobs once all are known (then forgotten), its embedding pooled."""
    req = entry.request
    if entry.prompt_rows is not None and not req.prompt_logprobs_pending:
        got = [entry.prompt_rows[p] for p in range(1, req.num_prompt_tokens)]
        el.prompt_logprobs = [None] + [lp for lp, _ in got]
        el.prompt_top_logprobs = [[]] + [top for _, top in got]
        entry.prompt_rows = None
    if entry.embed is not None:
        entry.embed.finish()
