"""The order of a pool stream's last replies, both sides, with no pool: the servicer's Generate loop against a
queue whose request finishes between the loop's two looks at it (the engine thread acting in between), and the
client's stream reader against a hand-written last reply. A reader must never see a terminal status while tokens
of its request are still to come, nor an error status without its message."""
from __future__ import annotations

import asyncio

from allspark_client import GenerateRequestStatus as S
from allspark_client._proto import allspark_pb2 as pb
from allspark_client.generate_stream import read_generate_stream
from allspark_client.result_queue import ResultQueue
from allspark_client.types import AsStatus, GeneratedElements, RequestHandle
from allspark_server.pool.service import AllsparkServicer


class FinishesDuringTheLook(ResultQueue):
    """Each take of tokens is followed at once by two more tokens and the terminal status: what the engine
    thread does when it runs the request's last steps between the stream's take and its status read."""

    def GetNoWait(self):
        el = super().GetNoWait()
        if el is not None and not self.GenerateStatus().is_terminal:
            self._push(GeneratedElements(ids_from_generate=[7, 8]), S.Generating)
            self._set_status(S.GenerateFinished)
        return el


class OneRequestEngine:
    """The one Engine call the Generate loop makes, answering with a prepared queue."""

    def __init__(self, queue: ResultQueue):
        self.queue = queue

    def start_request(self, name, inputs, gen):
        return AsStatus.ALLSPARK_SUCCESS, RequestHandle(name, 1), self.queue

    def get_last_error(self):
        return ""


def replies_of(queue: ResultQueue) -> list[pb.GenerateReply]:
    servicer = AllsparkServicer(OneRequestEngine(queue), world_size=1)

    async def drain():
        return [r async for r in servicer._generate(pb.GenerateRequest(model_name="m", input_ids=[1, 2]))]
    return asyncio.run(drain())


def test_the_terminal_reply_comes_after_every_token():
    queue = FinishesDuringTheLook()
    queue._push(GeneratedElements(ids_from_generate=[5]), S.ContextFinished)
    replies = replies_of(queue)
    statuses = [S(r.generate_status) for r in replies]
    first_terminal = next(i for i, s in enumerate(statuses) if s.is_terminal)
    assert first_terminal == len(replies) - 1, statuses            # nothing after the first terminal reply
    assert [t for r in replies for t in r.ids] == [5, 7, 8]
    assert replies[-1].stats.generated_token_length == 3          # the last reply carries the stats


class FakeCall:
    def __init__(self, replies):
        self.replies = replies

    def __iter__(self):
        return iter(self.replies)


def seen_by_a_reader(replies) -> list[tuple]:
    """(status, tokens in, error message) each time the reader's queue changes while the client reads `replies`."""
    queue, seen = ResultQueue(), []
    queue._set_listener(lambda: seen.append((queue.GenerateStatus(), queue.GeneratedLength(), queue.ErrorMessage())))
    read_generate_stream(FakeCall(replies), queue, "unix:/nowhere")     # ClientEngine's stream reader
    return seen


def test_the_client_sets_a_last_replys_status_after_its_tokens_and_with_its_message():
    replies = [pb.GenerateReply(status=0, request_id=1, generate_status=int(S.ContextFinished), ids=[5]),
               pb.GenerateReply(status=0, request_id=1, generate_status=int(S.InternalError), ids=[7, 8],
                                message="the pool lost a rank")]
    seen = seen_by_a_reader(replies)
    terminal = [s for s in seen if s[0].is_terminal]
    assert terminal and terminal[0] == (S.InternalError, 3, "the pool lost a rank"), seen
