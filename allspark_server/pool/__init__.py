"""One pool rank: its entry point (`python -m allspark_server`), the gRPC service on rank 0, the worker loop of the
other ranks, the watchdogs that end a stuck or orphaned pool, CPU placement and socket access."""
