"""Shared by tests/pool/test_http_*.py (and test_smollm2_serve.py, tests/models/test_qwen_tokenizer.py): an
allspark-serve subprocess on a free port (waited for through /health,
stopped with SIGTERM, every process it started killed at the end), a copy of a HF folder with a chat template,
/metrics parsed with prometheus-client's parser, and the Engine's greedy reference decoded."""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
from pool_helpers import _is_rank
from prometheus_client.parser import text_string_to_metric_families

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 180.0
API_KEY = "test-key-123"
CHAT_MAX_LENGTH = 8192        # the session's chat server (conftest's chat_llama_server): room for requests that
                              # run until a test stops them (helpers.LONG_RUN_*)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_server(llama, tmp_path_factory, *args: str) -> "Server":
    """allspark-serve on a copy of the tiny Llama folder with CHAT_TEMPLATE, behind API_KEY; `model_dir` is the copy
    (its tokenizer: `folder_tokenizer`). `args`: the server's options."""
    hf_dir = with_chat_template(llama.hf_dir, str(tmp_path_factory.mktemp("chat") / "llama"))
    srv = Server(hf_dir, *args, api_key=API_KEY)
    srv.model_dir = hf_dir
    return srv


def folder_tokenizer(server: "Server"):
    """The tokenizer of the server's own folder (with the chat template)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(server.model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_chat_template(src_dir: str, dst_dir: str) -> str:
    """A copy of the HF folder whose tokenizer_config.json has CHAT_TEMPLATE."""
    shutil.copytree(src_dir, dst_dir)
    path = os.path.join(dst_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst_dir


_CACHE_ROOT: list[str] = []      # the session's serialized models, made at the first server
_CACHE_LOCK = threading.Lock()   # servers may start from several threads at once


def cache_dir_for(model_dir: str, name: str) -> str:
    """A server's --cache-dir: one per model folder and served name for the session, so that a later server of the
    same folder finds the model serialized, as a user's second start does (the first start serializes it)."""
    with _CACHE_LOCK:
        if not _CACHE_ROOT:
            _CACHE_ROOT.append(tempfile.mkdtemp(prefix="as-http-cache-"))
            atexit.register(shutil.rmtree, _CACHE_ROOT[0], True)
    key = hashlib.sha256(f"{os.path.abspath(model_dir)}\0{name}".encode()).hexdigest()[:16]
    return os.path.join(_CACHE_ROOT[0], key)


class Server:
    """`python -m allspark_server.http` on 127.0.0.1:<free port>; `url` is its root, `base_url` its /v1. Its model
    is serialized into cache_dir_for(model_dir, name)."""

    def __init__(self, model_dir: str, *args: str, api_key: str | None = None, name: str = "llama"):
        self.dir = tempfile.mkdtemp(prefix="as-http-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.log_path = os.path.join(self.dir, "server.log")
        cmd = [sys.executable, "-m", "allspark_server.http", "--model", model_dir, "--served-model-name", name,
               "--cache-dir", cache_dir_for(model_dir, name), "--dtype", "float32", "--port", str(self.port),
               "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        self._wait_ready()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"allspark-serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"allspark-serve not ready after {START_TIMEOUT_S}s:\n{self.log()}")

    def diagnosis(self) -> str:
        """What a test that waited in vain shows: the machine's load and memory, the server's processes (state, CPU
        time, RSS), then every thread's stack of the server and its pool's ranks (SIGUSR1, which both answer with
        faulthandler) as their logs have them."""
        try:
            server = psutil.Process(self.proc.pid)
            procs = [server] + server.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        vm, swap = psutil.virtual_memory(), psutil.swap_memory()
        lines = [f"load {os.getloadavg()}, memory available {vm.available >> 20} MiB of {vm.total >> 20}, "
                 f"swap used {swap.used >> 20} MiB"]
        logs = [self.log_path]
        for p in procs:
            try:
                cmd, t = p.cmdline(), p.cpu_times()
                lines.append(f"{p.pid} {p.status()} user {t.user:.1f} s sys {t.system:.1f} s "
                             f"rss {p.memory_info().rss >> 20} MiB: {' '.join(cmd)[:160]}")
                if "--socket" in cmd:        # a spawned pool's ranks: their output goes to pool.log beside it
                    logs.append(os.path.join(os.path.dirname(cmd[cmd.index("--socket") + 1]), "pool.log"))
                if p.pid == self.proc.pid or _is_rank(p):      # not the launcher: SIGUSR1 would end it
                    p.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
        time.sleep(1.0)
        for path in dict.fromkeys(logs):
            try:
                with open(path, errors="replace") as f:
                    lines.append(f"--- {path}:\n{f.read()[-12000:]}")
            except OSError as e:
                lines.append(f"--- {path}: {e}")
        return "\n".join(lines)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body=None, content: bytes | None = None, headers: dict | None = None,
             timeout: float = 60) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body if content is None else None, content=content,
                          headers=self.headers() if headers is None else headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: 'name{label="v",...}' (labels sorted) or 'name' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown also ends a pool the server spawned); whatever is left is killed."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_greedy_text(engine, tokenizer, ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """The in-process Engine's greedy continuation (model EOS on) and its text as the server decodes it."""
    from helpers import generate
    tokens, _ = generate(engine, "llama", ids, {"top_k": 1, "max_new_tokens": max_tokens})
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False), tokens
