"""What the engine thread applies to a served model between its steps (engine/thread.py, served_model.py):
a request to add, with its queue, its sampling state and what it collects besides tokens, or a request to stop."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Union

from allspark_client.result_queue import ResultQueue
from allspark_server.core.request import Request
from allspark_server.runner.row_outputs import EmbedJob
from allspark_server.runner.sample_types import SamplingState


@dataclass
class AddRequest:
    request: Request
    queue: ResultQueue
    sampling: SamplingState
    prompt_rows: Optional[dict] = None    # prompt_logprobs: position -> (logprob, top), until delivered
    embed: Optional[EmbedJob] = None      # an embedding request's pooling and result (engine/embed_api.py)


@dataclass
class StopRequest:
    request_id: int
    done: threading.Event = field(default_factory=threading.Event)


Command = Union[AddRequest, StopRequest]
