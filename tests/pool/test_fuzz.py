"""Hostile input, property-based (Hypothesis): random and mutated protobuf messages on every gRPC method of a real
2-rank pool, and random generation configs and input ids through both engines. Nothing may crash, hang, or
escape as anything but a status / AsException (on the wire: no UNKNOWN, which is an exception a servicer let
out, no UNAVAILABLE or DEADLINE_EXCEEDED, which are a dead or wedged pool), and each engine still serves exact
greedy output afterwards, with every request released.

Examples per surface: $ALLSPARK_FUZZ_EXAMPLES (CI: 300; the slow run: ALLSPARK_FUZZ_EXAMPLES=10000). Derandomized,
so a CI failure reproduces; `--hypothesis-seed` / the printed example reproduce others."""
from __future__ import annotations

import grpc
import pytest
from helpers import greedy, random_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_helpers import MODEL, install

from allspark_client import AsException, AsStatus, GenerateRequestStatus
from allspark_client._proto import allspark_pb2 as pb
from allspark_client.settings import FUZZ_EXAMPLES

EXAMPLES = FUZZ_EXAMPLES.get()
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CALL_TIMEOUT_S = 30.0
WIRE_FAILURES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
NOT_INSTALLED = "fuzz-not-installed"      # destructive methods' seed messages name a model nobody serves

# method -> (response is a stream, seed messages whose bytes are mutated)
METHODS = {
    "Health": (False, [pb.HealthRequest()]),
    "InstallModel": (False, [pb.RuntimeConfig(model_name=NOT_INSTALLED, model_path="/nonexistent/m.asgraph",
                                              engine_max_length=64, engine_max_batch=2,
                                              kv_cache_memory_bytes=1 << 20)]),
    "StartModel": (False, [pb.ModelRef(model_name=NOT_INSTALLED)]),
    "StopModel": (False, [pb.ModelRef(model_name=NOT_INSTALLED)]),
    "ReleaseModel": (False, [pb.ModelRef(model_name=NOT_INSTALLED)]),
    "Generate": (True, [pb.GenerateRequest(model_name=MODEL, input_ids=[5, 6, 7],
                                           config=pb.GenerationConfig(top_k=1, max_new_tokens=4))]),
    "StopRequest": (False, [pb.RequestRef(model_name=MODEL, request_id=1)]),
    "ReleaseRequest": (False, [pb.RequestRef(model_name=MODEL, request_id=1)]),
    "SyncRequest": (False, [pb.SyncRequestMsg(model_name=NOT_INSTALLED)]),
    "GetModelInfo": (False, [pb.ModelRef(model_name=MODEL)]),
    "GetEngineStat": (False, [pb.ModelRef(model_name=MODEL)]),
    "GetOpProfile": (False, [pb.ModelRef(model_name=MODEL)]),
}


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """The seed's bytes with a few random edits: flips, inserts, deletes, truncation."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1))) if data else 0
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at:at + draw(st.integers(1, 4))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


@st.composite
def wire_calls(draw):
    method = draw(st.sampled_from(sorted(METHODS)))
    streaming, seeds = METHODS[method]
    payload = draw(st.one_of(st.binary(max_size=256),
                             mutated(draw(st.sampled_from(seeds)).SerializeToString())))
    return method, streaming, payload


@pytest.fixture(scope="module")
def fuzz_pool(loader):
    """A 2-rank pool of its own (the fuzzing must not disturb the session's), serving the GQA Llama."""
    from pool_helpers import Pool
    pool = Pool(2)
    try:
        pool.wait_ready(2)
        client = pool.client()
        install(client, loader)
        yield pool, client
    finally:
        pool.kill()


def test_random_and_mutated_messages_on_every_grpc_method(fuzz_pool, served_llama):
    pool, client = fuzz_pool
    engine, _ = served_llama
    channel = grpc.insecure_channel(pool.address)
    prompt = random_prompt(12, seed=77)
    want = greedy(engine, "llama", prompt, 8)
    seen: dict[str, int] = {}

    @FUZZ
    @given(wire_calls())
    def call(example):
        method, streaming, payload = example
        path = f"/allspark.v1.Allspark/{method}"
        seen[method] = seen.get(method, 0) + 1
        try:
            if streaming:
                stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S)
                for i, _ in enumerate(stream):
                    if i == 2:          # a started request: leave mid-stream (the pool releases it)
                        stream.cancel()
                        break
            else:
                channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            assert e.code() not in WIRE_FAILURES, (method, payload, e.code(), e.details(), pool.log())

    try:
        call()
    finally:
        channel.close()
    print("\nwire:", seen)
    assert set(seen) == set(METHODS), seen
    assert greedy(client, MODEL, prompt, 8) == want            # still serving, exactly
    assert _all_released(client)


def _all_released(engine) -> bool:
    from pool_helpers import wait_until
    return wait_until(lambda: engine.get_as_engine_stat(MODEL).running_request == 0, 30.0, 0.1)


# ---- generation configs and input ids through both engines ----------------------------------------
KEYS = ["temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "min_length", "max_length", "max_new_tokens", "eos_token_id", "stop_words_ids", "seed", "logprobs",
        "top_logprobs", "do_sample", "response_format", "num_beams", "lora_name", "bogus", ""]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 600),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.lists(st.integers(-5, 600), max_size=4), st.lists(st.lists(st.integers(-5, 600), max_size=3),
                                                                         max_size=3),
                   st.dictionaries(st.text(max_size=6), st.integers(), max_size=2))
CONFIGS = st.one_of(st.none(), st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6),
                    st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=3))
INPUT_IDS = st.one_of(st.lists(st.integers(-3, 600), max_size=40), st.lists(st.integers(-2**70, 2**70), max_size=4),
                      st.just([]), st.text(max_size=5), st.none(), st.floats(),
                      st.lists(st.one_of(st.floats(), st.text(max_size=2), st.booleans()), min_size=1, max_size=3))
INPUTS = st.one_of(st.builds(lambda ids: {"input_ids": ids}, INPUT_IDS),
                   st.dictionaries(st.sampled_from(["input_ids", "attention_mask", "pixel_values"]), INPUT_IDS,
                                   max_size=3),
                   INPUT_IDS)
# plausible requests too, with values inside the rules, so the serving side is fuzzed as well as the refusals
VALID_INPUTS = st.builds(lambda ids: {"input_ids": ids}, st.lists(st.integers(0, 511), min_size=1, max_size=40))
VALID_CONFIGS = st.fixed_dictionaries({"max_new_tokens": st.integers(1, 6)}, optional={
    "temperature": st.floats(0.05, 3.0), "top_k": st.integers(0, 600), "top_p": st.floats(0.01, 1.0),
    "repetition_penalty": st.floats(0.5, 2.0), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "min_length": st.integers(0, 8), "seed": st.integers(0, 2**63 - 1),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 10), "do_sample": st.booleans(),
    "eos_token_id": st.lists(st.integers(0, 511), max_size=3),
    "stop_words_ids": st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=3), max_size=3)})
REQUESTS = st.one_of(st.tuples(VALID_INPUTS, VALID_CONFIGS), st.tuples(VALID_INPUTS, CONFIGS),
                     st.tuples(INPUTS, VALID_CONFIGS), st.tuples(INPUTS, CONFIGS))


@pytest.mark.parametrize("which", ["engine", "pool"])
def test_random_configs_and_input_ids_through_both_engines(which, served_llama, fuzz_pool):
    engine, name = (served_llama[0], "llama") if which == "engine" else (fuzz_pool[1], MODEL)
    prompt = random_prompt(12, seed=78)
    want = greedy(engine, name, prompt, 8)
    outcomes = {"refused": 0, "served": 0}

    @FUZZ
    @given(REQUESTS)
    def request(example):
        inputs, config = example
        try:
            status, handle, queue = engine.start_request(name, inputs, config)
        except AsException as e:            # allowed: a documented error (the API may raise it)
            assert e.message, e
            outcomes["refused"] += 1
            return
        if status != AsStatus.ALLSPARK_SUCCESS:
            assert handle is None and engine.get_last_error(), (status, inputs, config)
            outcomes["refused"] += 1
            return
        outcomes["served"] += 1
        try:
            el = queue.GetWithTimeout(int(CALL_TIMEOUT_S * 1000))   # the first tokens, or the end: never a hang
            assert el is not None or queue.GenerateStatus().is_terminal, (inputs, config)
            assert queue.GenerateStatus() != GenerateRequestStatus.InternalError, queue.ErrorMessage()
        finally:
            assert engine.release_request(name, handle) == AsStatus.ALLSPARK_SUCCESS

    request()
    print(f"\n{which}: {outcomes}")
    assert outcomes["refused"] and outcomes["served"], outcomes     # both sides of the validation were reached
    assert greedy(engine, name, prompt, 8) == want
    assert _all_released(engine)
