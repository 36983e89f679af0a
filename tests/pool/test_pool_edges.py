"""Pool edges tried as a hostile operator would (issue 38, part 8), the launcher's side: a second pool on a socket a
live pool answers on is refused naming that pool, and the first pool still answers; a pool removes only the socket
it bound; wrong types in a pool config and bad flag values are refused at once naming key and value (under --dry-run
too); allspark-health says what is at an address that is not a pool; --dry-run prints what the launcher adds."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading

import pytest
from pool_helpers import REPO, repo_env, wait_until

from allspark_client import ClientEngine
from allspark_client.launch.health import main as health_main
from allspark_client.launch.launcher import main as launch_main

REFUSAL_S = 90.0      # a refused launcher exits long before this; one that started a pool would run on


def run_until_exit(argv: list[str], timeout_s: float = REFUSAL_S) -> subprocess.CompletedProcess:
    """Run a command that must end by itself; one still running after timeout_s is killed (its whole session) and
    fails the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=repo_env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} still ran after {timeout_s:.0f} s: it did not refuse\n{err.decode()[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())


# ---- a live pool's socket ---------------------------------------------------------------------------
def test_a_second_pool_on_a_live_socket_is_refused_naming_it(new_pool):
    pool = new_pool()
    rank0 = rank0_pid(pool.address)
    for argv in ([sys.executable, "-m", "allspark_client.launch.launcher", "--ranks", "2", "--socket", pool.socket],
                 [sys.executable, "-m", "allspark_server", "--socket", pool.socket]):   # rank 0 refuses it too
        out = run_until_exit(argv)
        assert out.returncode != 0, out.stderr[-3000:]
        assert pool.socket in out.stderr and "refusing to" in out.stderr, out.stderr[-3000:]
        if "launcher" in argv[2]:
            assert f"a pool serves on {pool.socket} (rank 0 pid {rank0}, 2 rank(s)" in out.stderr, out.stderr
        assert health_main([pool.address, "--timeout", "20"]) == 0          # the first pool still answers
        assert rank0_pid(pool.address) == rank0


def rank0_pid(address: str) -> int:
    client = ClientEngine(address, start_timeout_s=60)
    try:
        return client.health.pid
    finally:
        client.close()


def start_launcher(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "allspark_client.launch.launcher", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, cwd=REPO, env=repo_env(), start_new_session=True)


def stop_launcher(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher (a clean stop), SIGKILL to its session after 60 s (mpirun then ends the ranks)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_pool_removes_only_the_socket_it_bound(new_pool):
    """The operator removes pool A's socket and starts pool B on the same path; when A stops, B's socket stays."""
    first = new_pool(ranks=1)
    rank0_a = rank0_pid(first.address)
    os.unlink(first.socket)
    second = start_launcher("--ranks", "1", "--socket", first.socket)
    try:
        assert health_main([first.address, "--timeout", "120"]) == 0
        rank0_b = rank0_pid(first.address)
        assert rank0_b != rank0_a
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=60) == 0, first.log()
        assert os.path.exists(first.socket), "pool A removed pool B's socket"
        assert rank0_pid(first.address) == rank0_b       # B is still reachable
    finally:
        stop_launcher(second)


# ---- allspark-health ---------------------------------------------------------------------------------
def serve_unix(path: str, answer: bytes | None) -> socket.socket:
    """A unix socket server that accepts and answers `answer` to anything, or (None) never says a word."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)

    def loop():
        held = []
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.recv(1024)
                conn.sendall(answer)
                conn.close()
    threading.Thread(target=loop, daemon=True).start()
    return server


def health(capsys, address: str, timeout_s: float) -> tuple[int, str]:
    code = health_main([address, "--timeout", str(timeout_s)])
    return code, capsys.readouterr().err


def test_health_says_what_is_at_an_address_that_is_not_a_pool(tmp_path, capsys):
    """Not a socket, a server that is not HTTP/2, a silent one: exit 1 at once, saying so, where the old probe
    waited its whole --timeout and said DEADLINE_EXCEEDED. Nothing there or a
    stale socket may be a pool starting: it says so at once, waits --timeout, and names it at the end."""
    (tmp_path / "file").write_text("x")
    http1 = serve_unix(str(tmp_path / "http1.sock"), b"HTTP/1.1 400 Bad Request\r\n\r\n")
    silent = serve_unix(str(tmp_path / "silent.sock"), None)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    try:
        for name, needle in (("file", "is not a socket (a regular file)"),
                             ("http1.sock", "answers but not in HTTP/2 (it said 'HTTP/1.1 400 Bad Request')"),
                             ("silent.sock", "does not answer in HTTP/2")):
            code, err = health(capsys, f"unix:{tmp_path / name}", 60)
            assert code == 1 and "not a pool: " in err and needle in err, (name, err)
        for name, needle in (("missing.sock", "does not exist"), ("stale.sock", "is a stale socket")):
            code, err = health(capsys, f"unix:{tmp_path / name}", 1)
            first, last = err.strip().splitlines()[0], err.strip().splitlines()[-1]
            assert code == 1 and first.startswith("waiting up to 1 s: ") and needle in first, err
            assert last.startswith("not ready after 1 s: ") and needle in last, err
            assert "DEADLINE_EXCEEDED" not in err
    finally:
        http1.close()
        silent.close()


# ---- configuration values ---------------------------------------------------------------------------
BAD_POOL_VALUES = [('ranks = "2"', "[pool] ranks must be an integer >= 1, got '2' (str)"),
                   ("ranks = 0", "[pool] ranks must be an integer >= 1, got 0 (int)"),
                   ("socket = 5", "[pool] socket must be a non-empty string, got 5 (int)"),
                   ("numa_nodes = 0", "[pool] numa_nodes must be a list of distinct NUMA node numbers like [0, 1], "
                                      "got 0 (int)"),
                   ('threads_per_rank = "all"', "[pool] threads_per_rank must be an integer >= 0, got 'all' (str)"),
                   ("port = 70000", "[pool] port must be an integer from 1 to 65535, got 70000 (int)"),
                   ('step_timeout = "5"', "[pool] step_timeout must be a number of seconds >= 0, got '5' (str)"),
                   ("allow_remote = 1", "[pool] allow_remote must be true or false, got 1 (int)")]
MODEL = '[[model]]\nname = "m"\ngraph = "/x/m.asgraph"\nweights = "/x/m.asparam"\n'


@pytest.mark.parametrize("line,message", BAD_POOL_VALUES + [
    (MODEL + 'start = "no"', "[[model]] start must be true or false, got 'no' (str)"),
    (MODEL + "max_batch = -4", "[[model]] max_batch must be an integer >= 1, got -4 (int)"),
    (MODEL + 'kv_cache_memory_bytes = "1G"', "[[model]] kv_cache_memory_bytes must be an integer >= 0, got '1G'")])
def test_wrong_types_in_a_pool_config_are_refused_naming_key_and_value(tmp_path, line, message):
    cfg = tmp_path / "pool.toml"
    cfg.write_text(("" if line.startswith("[[model]]") else "[pool]\n") + line + "\n")
    with pytest.raises(SystemExit) as e:                        # under --dry-run too, before anything runs
        launch_main(["--pool-config", str(cfg), "--topology", "0:0-3", "--dry-run"])
    assert str(e.value.code).startswith(f"allspark-launch: pool config {str(cfg)!r}: {message}"), e.value.code


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "-1"], "argument --ranks: must be an integer >= 1, got '-1'"),
    (["--ranks", "0"], "argument --ranks: must be an integer >= 1, got '0'"),
    (["--threads-per-rank", "-1"], "argument --threads-per-rank: must be an integer >= 0, got '-1'"),
    (["--numa-nodes", "0,x"], "argument --numa-nodes: must be distinct NUMA node numbers like 0,1, got '0,x'"),
    (["--port", "0"], "argument --port: must be an integer from 1 to 65535, got '0'"),
    (["--step-timeout", "nan"], "argument --step-timeout: must be a number >= 0, got 'nan'")])
def test_bad_flag_values_are_refused_naming_flag_and_value(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        launch_main(argv + ["--topology", "0:0-3", "--dry-run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


# ---- --dry-run ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("root", [True, False])
def test_dry_run_prints_what_the_launcher_adds(capsys, monkeypatch, root):
    monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.delenv("OMPI_MCA_btl_vader_backing_directory", raising=False)
    monkeypatch.delenv("OMPI_MCA_btl_sm_backing_directory", raising=False)
    assert launch_main(["--topology", "0:0-3", "--ranks", "2", "--socket", "/tmp/x.sock", "--dry-run",
                        "--mpirun", "mpirun"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cmd = shlex.split(lines[1])
    assert cmd[0] == "env"
    at = next(i for i, tok in enumerate(cmd[1:], 1) if "=" not in tok)
    added = dict(tok.split("=", 1) for tok in cmd[1:at])
    assert os.path.basename(cmd[at]) == "mpirun"
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in added and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in added) == root, added
    run_dir = added["TMPDIR"]
    assert os.path.basename(run_dir).startswith(f"allspark-launch-{os.getpid()}-")
    pid_files = [cmd[i + 1] for i, tok in enumerate(cmd) if tok == "--pid-file"]
    assert pid_files == [os.path.join(run_dir, "rank0.pid")] * 2, cmd          # every rank is told
    if os.access("/dev/shm", os.W_OK):
        assert added["OMPI_MCA_btl_vader_backing_directory"].startswith(f"/dev/shm/allspark-{os.getpid()}-")
    assert lines[2].startswith("# XXXXXXXX")


def test_the_dry_run_command_runs_as_printed(capsys, tmp_path):
    """The printed command, with real directories for its XXXXXXXX placeholders, starts the pool it describes, and
    rank 0 writes its pid where the launcher would look for it."""
    assert launch_main(["--ranks", "1", "--socket", str(tmp_path / "p.sock"), "--dry-run"]) == 0
    tokens = shlex.split(capsys.readouterr().out.strip().splitlines()[1])
    text = shlex.join(tokens)
    for name, real in (("TMPDIR", tmp_path / "run"), ("OMPI_MCA_btl_vader_backing_directory", tmp_path / "shm")):
        placeholder = [t.split("=", 1)[1] for t in tokens if t.startswith(name + "=")]
        if placeholder:
            real.mkdir()
            text = text.replace(placeholder[0], str(real))
    proc = subprocess.Popen(shlex.split(text), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=REPO,
                            env=repo_env(), start_new_session=True)
    try:
        assert health_main([f"unix:{tmp_path / 'p.sock'}", "--timeout", "120"]) == 0
        assert wait_until(lambda: os.path.exists(tmp_path / "run" / "rank0.pid"), 10)
    finally:
        stop_launcher(proc)
