"""The scripts a second client process runs against a pool (test_pool_grpc.py): one that streams two greedy
requests and prints their tokens, one that dies mid-stream."""
import textwrap

CLOSE_LIMIT_S = 60
CLIENT_SCRIPT = textwrap.dedent("""
    import faulthandler, json, sys, time
    from allspark_client import ClientEngine, GenerateRequestStatus
    address, prompts, n, CLOSE_LIMIT_S = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    client = ClientEngine(address, start_timeout_s=60)
    print("CONNECTED", flush=True)
    sys.stdin.readline()  # wait for "go": the parent starts its long request only now
    go = time.monotonic()
    started = []
    for ids in prompts:
        status, handle, queue = client.start_request("llama", {"input_ids": ids},
                                                     {"top_k": 1, "max_new_tokens": n, "eos_token_id": []})
        assert status == 0, client.get_last_error()
        started.append((handle, queue))
    out = []
    for handle, queue in started:
        tokens = []
        while (el := queue.Get()) is not None:
            tokens.extend(el.ids_from_generate)
        assert queue.GenerateStatus() == GenerateRequestStatus.GenerateFinished, queue.ErrorMessage()
        client.release_request("llama", handle)
        out.append(tokens)
    print(f"{time.monotonic() - go:.2f} s from go to results", flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    # one CI run saw this process still alive 120 s after its results: should closing hang, every thread's stack
    # is printed and the process ends, so the test shows where
    faulthandler.dump_traceback_later(CLOSE_LIMIT_S, exit=True)
    client.close()
    faulthandler.cancel_dump_traceback_later()
    print("CLOSED", flush=True)
""")


DYING_CLIENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from allspark_client import ClientEngine
    client = ClientEngine(sys.argv[1], start_timeout_s=60)
    status, handle, queue = client.start_request("llama", {"input_ids": [5, 6, 7]},
                                                 {"top_k": 1, "max_new_tokens": int(sys.argv[2]), "eos_token_id": []})
    assert status == 0, client.get_last_error()
    queue.Get()
    print("STREAMING", flush=True)
    time.sleep(600)
""")
