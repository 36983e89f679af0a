"""LoRA adapters through ClientEngine (docs/api.md, "LoRA adapters"): `lora_name` in the generation config and the
runtime config's limits across the wire; LoadLora / UnloadLora / ListLoras carrying the Engine's statuses and reasons
(a servicer in this process over a fake engine); and on a real 2-rank pool, a PEFT adapter made with random weights:
greedy output with `lora_name` equals transformers + PEFT and differs from the base model's, which stays exact, with
every status code where DashInfer returns it and an adapter serialized to `.aslora` loaded by name."""
from __future__ import annotations

import copy
import os
import threading

import pytest
from pool_helpers import REDO_SPOILED

from allspark_client import AsException, AsStatus, ClientEngine, wire
from allspark_client._proto import allspark_pb2 as pb
from allspark_client.api import EngineAPI
from allspark_client.config import AsModelConfig
from allspark_client.generation_config import parse_generation_config
from allspark_client.validation import ConfigError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
TOKENS = 12


def engine_has_lora() -> bool:
    from allspark_server import Engine
    return Engine.load_lora is not EngineAPI.load_lora


needs_engine_lora = pytest.mark.skipif(not engine_has_lora(),
                                       reason="the engine side of LoRA (Engine.load_lora) has not landed yet")


def make_peft_adapter(model, out_dir: str, rank: int = 8, seed: int = 1, scale: float = 0.2):
    """A PEFT adapter on all seven projections with random A and B (B scaled by `scale`, so the output changes but
    does not collapse into one repeated token), saved to `out_dir`. Returns the PeftModel (eval)."""
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.eval()
    peft_model.save_pretrained(out_dir)
    return peft_model


# ---- the generation config and the runtime config across the wire ------------------------------------------------
def test_lora_name_in_the_generation_config():
    assert parse_generation_config({"lora_name": "ad1"}).lora_name == "ad1"
    for base in ("", None):
        assert parse_generation_config({"lora_name": base}).lora_name is None
    assert parse_generation_config({}).lora_name is None
    for bad in (3, b"ad1", ["ad1"], True):
        with pytest.raises(ConfigError, match="lora_name must be a string") as e:
            parse_generation_config({"lora_name": bad})
        assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR
    for raw, sent in (({"lora_name": "ad1", "top_k": 1}, {"lora_name": "ad1", "top_k": 1}),
                      ({"lora_name": ""}, {}), ({"lora_name": None}, {})):
        msg = pb.GenerationConfig.FromString(
            wire.generation_config_to_proto(raw, parse_generation_config(raw)).SerializeToString())
        assert wire.generation_config_from_proto(msg) == sent
        assert parse_generation_config(wire.generation_config_from_proto(msg)) == parse_generation_config(raw)


def test_lora_limits_in_the_runtime_config():
    cfg = AsModelConfig("m", "/x/m.asgraph", "/x/m.asparam", lora_max_num=2, lora_max_rank=16)
    msg = pb.RuntimeConfig.FromString(wire.runtime_config_to_proto(cfg).SerializeToString())
    assert (msg.lora_max_num, msg.lora_max_rank) == (2, 16)
    assert wire.runtime_config_from_proto(msg) == cfg
    zero = AsModelConfig("m", "/x/m.asgraph", "/x/m.asparam", lora_max_num=0)      # 0: no adapters, still sent
    assert wire.runtime_config_from_proto(wire.runtime_config_to_proto(zero)).lora_max_num == 0
    msg.ClearField("lora_max_num")
    msg.ClearField("lora_max_rank")                 # a client that does not know the fields: the defaults
    back = wire.runtime_config_from_proto(msg)
    assert (back.lora_max_num, back.lora_max_rank) == (AsModelConfig.lora_max_num, AsModelConfig.lora_max_rank)


# ---- the RPCs, against a fake engine behind the real service -------------------------------------------------------
class FakeLoraEngine:
    """The Engine's LoRA calls as the contract says, with the reason of each failure for get_last_error."""

    def __init__(self):
        self.loaded: dict[str, object] = {}
        self.calls: list[tuple] = []
        self.in_use: set[str] = set()
        self._errors = threading.local()

    def down_reason(self):
        return None

    def _fail(self, status, message):
        self._errors.message = message
        return status

    def get_last_error(self):
        return getattr(self._errors, "message", "")

    def _check_model(self, model_name):
        if model_name != "m":
            raise AsException(AsStatus.ALLSPARK_PARAM_ERROR, f"model {model_name!r} is not installed")

    def load_lora(self, model_name, lora_name, path=None):
        self.calls.append(("load", model_name, lora_name, path))
        if model_name != "m":
            return self._fail(AsStatus.ALLSPARK_PARAM_ERROR, f"model {model_name!r} is not installed")
        if lora_name in self.loaded:
            return self._fail(AsStatus.ALLSPARK_LORA_ALREADY_LOADED, f"LoRA adapter {lora_name!r} is loaded already")
        if path is not None and "missing" in path:
            return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND, f"no LoRA adapter at {path!r}")
        if len(self.loaded) >= 2:
            return self._fail(AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR, "lora_max_num is 2")
        self.loaded[lora_name] = path
        return AsStatus.ALLSPARK_SUCCESS

    def unload_lora(self, model_name, lora_name):
        self.calls.append(("unload", model_name, lora_name))
        if lora_name not in self.loaded:
            return self._fail(AsStatus.ALLSPARK_LORA_NOT_FOUND, f"LoRA adapter {lora_name!r} is not loaded")
        if lora_name in self.in_use:
            return self._fail(AsStatus.ALLSPARK_LORA_IN_USE, f"LoRA adapter {lora_name!r} is in use by 1 request")
        del self.loaded[lora_name]
        return AsStatus.ALLSPARK_SUCCESS

    def list_loras(self, model_name):
        self._check_model(model_name)
        return sorted(self.loaded)


@pytest.fixture(scope="module")
def fake_pool(tmp_path_factory):
    from allspark_server.pool.service import AllsparkServicer, start_server
    engine = FakeLoraEngine()
    servicer = AllsparkServicer(engine, world_size=1)
    servicer.ready = True
    address = f"unix:{tmp_path_factory.mktemp('lora_rpc')}/pool.sock"
    server = start_server(servicer, address)
    client = ClientEngine(address)
    yield engine, client
    client.close()
    server.stop(0).result()


def test_lora_rpcs_carry_the_engines_statuses_and_reasons(fake_pool, tmp_path, monkeypatch):
    engine, client = fake_pool
    OK = AsStatus.ALLSPARK_SUCCESS
    monkeypatch.chdir(tmp_path)
    assert client.load_lora("m", "b", "adapters/b") == OK                # a relative path: this process's directory
    assert engine.calls[-1] == ("load", "m", "b", os.path.join(str(tmp_path), "adapters", "b"))
    assert client.load_lora("m", "a") == OK                              # no path: the pool's rule (None there)
    assert engine.calls[-1] == ("load", "m", "a", None)
    assert client.list_loras("m") == ["a", "b"]
    cases = [(lambda: client.load_lora("m", "a", "/x"), AsStatus.ALLSPARK_LORA_ALREADY_LOADED, "loaded already"),
             (lambda: client.load_lora("m", "c", "/missing"), AsStatus.ALLSPARK_LORA_NOT_FOUND, "no LoRA adapter"),
             (lambda: client.load_lora("m", "c", "/x"), AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR, "lora_max_num"),
             (lambda: client.load_lora("other", "c"), AsStatus.ALLSPARK_PARAM_ERROR, "not installed"),
             (lambda: client.unload_lora("m", "zz"), AsStatus.ALLSPARK_LORA_NOT_FOUND, "not loaded")]
    for call, status, reason in cases:
        assert call() == status and reason in client.get_last_error()
    engine.in_use.add("a")
    assert client.unload_lora("m", "a") == AsStatus.ALLSPARK_LORA_IN_USE and "in use" in client.get_last_error()
    engine.in_use.clear()
    assert client.unload_lora("m", "a") == OK and client.unload_lora("m", "b") == OK
    assert client.list_loras("m") == []
    with pytest.raises(AsException) as e:
        client.list_loras("other")
    assert e.value.status == AsStatus.ALLSPARK_PARAM_ERROR and "not installed" in e.value.message
    n = len(engine.calls)                  # refused in the client: names that cannot travel as strings
    for call in (lambda: client.load_lora("m", ""), lambda: client.load_lora("m", 3),
                 lambda: client.load_lora(None, "a"), lambda: client.load_lora("m", "a", 5),
                 lambda: client.unload_lora("m", None)):
        assert call() == AsStatus.ALLSPARK_PARAM_ERROR and "must be" in client.get_last_error()
    assert len(engine.calls) == n


def test_lora_calls_after_close_are_refused(fake_pool):
    from allspark_client.client import CLOSED
    _, client = fake_pool
    other = ClientEngine(client.address)
    other.close()
    assert other.load_lora("m", "a") == AsStatus.ALLSPARK_INVALID_CALL_ERROR and other.get_last_error() == CLOSED
    assert other.unload_lora("m", "a") == AsStatus.ALLSPARK_INVALID_CALL_ERROR
    with pytest.raises(AsException) as e:
        other.list_loras("m")
    assert e.value.status == AsStatus.ALLSPARK_INVALID_CALL_ERROR


# ---- end to end: a 2-rank pool, transformers + PEFT as the reference ----------------------------------------------
@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Three PEFT adapters of the tiny Llama (ranks 8, 16 and 64) and their transformers + PEFT greedy tokens."""
    from helpers import hf_greedy
    root = tmp_path_factory.mktemp("peft")
    out = {}
    for name, rank, seed in (("ad8", 8, 1), ("ad16", 16, 2), ("ad64", 64, 3)):
        peft_model = make_peft_adapter(llama.model, str(root / name), rank=rank, seed=seed)
        out[name] = (str(root / name), hf_greedy(peft_model, PROMPT, TOKENS))
    return str(root), out


def _greedy(client, model, lora_name=None, max_new=TOKENS, prompt=PROMPT):
    from helpers import collect
    gen = {"top_k": 1, "max_new_tokens": max_new, "eos_token_id": []}
    if lora_name is not None:
        gen["lora_name"] = lora_name
    status, handle, queue = client.start_request(model, {"input_ids": prompt}, gen)
    assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    tokens, _, _ = collect(queue, timeout_s=60)
    assert client.release_request(model, handle) == AsStatus.ALLSPARK_SUCCESS
    return tokens


IN_USE_TOKENS = 4000   # a second or two of decoding: running when unload_lora comes, unless this process stalls


def _unload_refused_while_in_use(client, ad8_path: str) -> None:
    """unload_lora of an adapter a running request uses is LORA_IN_USE. An unload that succeeds is accepted only
    after a request that had generated all its tokens (this process stalled past its end on a loaded machine): then
    the adapter is loaded again and the premise set up anew, PREMISE_TRIES times in all."""
    from pool_helpers import PREMISE_TRIES, PremiseSpoiled, ran_out
    gen = {"top_k": 1, "max_new_tokens": IN_USE_TOKENS, "eos_token_id": [], "lora_name": "ad8"}
    for _ in range(PREMISE_TRIES):
        status, handle, queue = client.start_request("llama", {"input_ids": PROMPT}, gen)
        assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
        unloaded = client.unload_lora("llama", "ad8")
        if unloaded == AsStatus.ALLSPARK_SUCCESS:   # the last tokens of a request that had ended may be on their way
            queue._wait_terminal(timeout_s=1.0)
        ended = ran_out(queue, IN_USE_TOKENS)
        assert client.release_request("llama", handle) == AsStatus.ALLSPARK_SUCCESS
        if unloaded == AsStatus.ALLSPARK_LORA_IN_USE:
            assert "in use" in client.get_last_error()
            return
        assert unloaded == AsStatus.ALLSPARK_SUCCESS and ended, (
            f"unload_lora gave {unloaded.name} ({client.get_last_error()!r}) while its request was at "
            f"{queue.GeneratedLength()} of {IN_USE_TOKENS} tokens, {queue.GenerateStatus().name}")
        assert client.load_lora("llama", "ad8", ad8_path) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
    raise PremiseSpoiled(f"the request with the adapter ended before unload_lora came, {PREMISE_TRIES} times: "
                         "this process is stalled")


@needs_engine_lora
@REDO_SPOILED
def test_peft_adapters_on_a_two_rank_pool_equal_transformers(pool, llama, adapters):
    from helpers import assert_same_tokens, hf_ref
    client, _ = pool
    _, refs = adapters
    base = hf_ref(llama.model, PROMPT, TOKENS)
    try:
        for name, (path, _) in refs.items():
            assert client.load_lora("llama", name, path) == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
        assert client.list_loras("llama") == sorted(refs)
        for name, (_, want) in refs.items():
            assert want != base
            assert_same_tokens(_greedy(client, "llama", name), want, name)
        assert_same_tokens(_greedy(client, "llama", ""), base, "the base model")
        # both adapters and the base model in one batch
        from helpers import collect
        started = []
        for lora in ("ad8", None, "ad16", "ad64"):
            gen = {"top_k": 1, "max_new_tokens": TOKENS, "eos_token_id": [], "lora_name": lora}
            status, handle, queue = client.start_request("llama", {"input_ids": PROMPT}, gen)
            assert status == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
            started.append((lora, handle, queue))
        for lora, handle, queue in started:
            assert_same_tokens(collect(queue, timeout_s=60)[0], refs[lora][1] if lora else base, str(lora))
            assert client.release_request("llama", handle) == AsStatus.ALLSPARK_SUCCESS
        assert client.load_lora("llama", "ad8", refs["ad8"][0]) == AsStatus.ALLSPARK_LORA_ALREADY_LOADED
        status, _, _ = client.start_request("llama", {"input_ids": PROMPT}, {"lora_name": "nope"})
        assert status == AsStatus.ALLSPARK_LORA_NOT_FOUND and "nope" in client.get_last_error()
        _unload_refused_while_in_use(client, refs["ad8"][0])
    finally:
        for name in refs:
            client.unload_lora("llama", name)
    assert client.list_loras("llama") == []
    assert client.unload_lora("llama", "ad8") == AsStatus.ALLSPARK_LORA_NOT_FOUND
    assert_same_tokens(_greedy(client, "llama"), base, "the base model after unloading")


@needs_engine_lora
def test_aslora_files_and_the_limits_on_a_two_rank_pool(pool, llama, adapters, tmp_path):
    """serialize(..., lora_cfg) writes <dir>/<name>.aslora; load_lora(model, name) finds it beside the model file.
    A model installed with lora_max_num 1 and lora_max_rank 8 refuses a second adapter and one of rank 16."""
    from helpers import assert_same_tokens

    from allspark_server import HuggingFaceModel
    client, _ = pool
    root, refs = adapters
    name = "llama-lora-limits"
    loader = HuggingFaceModel(llama.hf_dir, name, user_set_data_type="float32")
    loader.load_model().serialize(None, model_output_dir=str(tmp_path), lora_cfg={
        "input_base_dir": root, "lora_names": ["ad8", "ad16"], "lora_only": False}).free_model()
    assert os.path.isfile(tmp_path / "ad8.aslora") and os.path.isfile(tmp_path / "ad16.aslora")
    cfg = (loader.create_reference_runtime_config_builder(name, "cpu", [0], max_batch=4).max_length(256)
           .kv_cache_span_size(16).lora_max_num(1).lora_max_rank(8).build())
    client.install_model(cfg)
    assert client.start_model(name) == AsStatus.ALLSPARK_SUCCESS
    try:
        assert client.load_lora(name, "ad16") == AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR
        assert "16" in client.get_last_error()
        assert client.load_lora(name, "missing") == AsStatus.ALLSPARK_LORA_NOT_FOUND
        assert client.load_lora(name, "ad8") == AsStatus.ALLSPARK_SUCCESS, client.get_last_error()
        assert client.load_lora(name, "ad8b", refs["ad8"][0]) == AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR
        assert_same_tokens(_greedy(client, name, "ad8"), refs["ad8"][1], "ad8 from its .aslora file")
        assert client.unload_lora(name, "ad8") == AsStatus.ALLSPARK_SUCCESS
    finally:
        client.stop_model(name, force=True)
        client.release_model(name, force=True)


BF16_NEAR_TIE = 0.1   # as tests/models/test_model_families.py: bf16 weights move these tiny models' logits ~0.04


@needs_engine_lora
def test_bf16_adapters_on_a_two_rank_pool_up_to_near_ties(pool, llama, tmp_path):
    """bf16 by the families' rule: each token transformers + PEFT's (fp32) argmax at that point or within a near tie
    of it, the tokens before the first near tie its own greedy ones; two adapters and the base model in one batch."""
    import torch
    from helpers import collect, installed_on_pool, serialize
    client, _ = pool
    name = "llama-bf16-lora"
    loader = serialize(llama.hf_dir, name, str(tmp_path), dtype="bfloat16")
    models = {lora: make_peft_adapter(llama.model, str(tmp_path / lora), rank=r, seed=s)
              for lora, r, s in (("b8", 8, 4), ("b64", 64, 5))}
    with installed_on_pool(client, loader, name) as c:
        for lora in models:
            assert c.load_lora(name, lora, str(tmp_path / lora)) == AsStatus.ALLSPARK_SUCCESS, c.get_last_error()
        started = []
        for lora in (*models, None):
            gen = {"top_k": 1, "max_new_tokens": TOKENS, "eos_token_id": [], "lora_name": lora}
            status, handle, queue = c.start_request(name, {"input_ids": PROMPT}, gen)
            assert status == AsStatus.ALLSPARK_SUCCESS, c.get_last_error()
            started.append((lora, handle, queue))
        got = {}
        for lora, handle, queue in started:
            got[lora] = collect(queue, timeout_s=60)[0]
            assert c.release_request(name, handle) == AsStatus.ALLSPARK_SUCCESS
    for lora, tokens in got.items():
        model = models[lora] if lora else llama.model
        with torch.no_grad():
            ref = model(torch.tensor([PROMPT + tokens])).logits[0].double()[len(PROMPT) - 1:-1]
        best, chosen = ref.max(-1).values, ref[torch.arange(len(tokens)), tokens]
        assert ((best - chosen) <= BF16_NEAR_TIE).all(), (lora, (best - chosen).tolist())
        top2 = ref.topk(2, -1).values
        tie_free = int(((top2[:, 0] - top2[:, 1]) > BF16_NEAR_TIE).to(torch.int).cumprod(0).sum())
        assert tokens[:tie_free] == ref.argmax(-1).tolist()[:tie_free], lora
