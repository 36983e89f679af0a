import subprocess, time
from pool_helpers import install, MODEL
from helpers import LONG_RUN_MAX_LENGTH
from test_pool_failures import start_streams, assert_streams_fail_within, FAULT_STREAMS

def test_strace(new_pool, loader):
    pool = new_pool()
    client = pool.client()
    install(client, loader, max_length=LONG_RUN_MAX_LENGTH, max_batch=8)
    worker = [p for p in pool.ranks() if p.pid != client.health.pid]
    rank0 = [p for p in pool.ranks() if p.pid == client.health.pid][0]
    queues = start_streams(client, pool)
    st = subprocess.Popen(["strace", "-f", "-tt", "-e", "trace=kill,tgkill,exit_group", "-e", "signal=all", "-p", str(rank0.pid)],
                          stderr=open("/tmp/strace.out", "w"))
    time.sleep(1.0)
    t = time.time(); print("kill at", time.strftime("%H:%M:%S", time.localtime(t)), t % 60)
    worker[0].kill()
    slowest = assert_streams_fail_within(queues, time.monotonic(), 5.0, pool=pool)
    time.sleep(1); st.terminate()
    print(open("/tmp/strace.out").read()[-3000:])
    print(pool.log()[-1500:])
