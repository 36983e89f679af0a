"""DashInfer compatibility check: every method of DashInfer's Engine and ClientEngine called on allspark's Engine and on
a ClientEngine of a 2-rank pool, and what each returns checked.

    python examples/dashinfer_compat.py [--ranks 2] [--address ADDR] [--engine-only] [--tokens 8]

A tiny random Llama is built with transformers (nothing is downloaded) and converted with
serialize_model_from_torch, as DashInfer's converter is called (model_type "LLaMA_v3", the HF config as a dict).
Greedy output is compared with transformers' greedy generate, through every way of reading it (ResultQueue, the
deprecated get_wait / get_no_wait, get_output_*), before and after unload_device_mem / load_device_mem, and from the
files save_model writes; a LoRA adapter (made here with peft) against transformers + PEFT. Deprecated calls must
warn (DeprecationWarning). Prints a table, method -> ok / MISSING (the engine lacks it) / FAILED (the reason) / NOT
RUN (an earlier check of its group failed), and exits 1 unless every call is ok.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import warnings
from typing import Callable

METHODS = [   # DashInfer's Engine and ClientEngine methods (reference: docs/api.md), in the order they are checked
    "serialize_model_from_torch", "get_file_information", "dump_build_meta_to_proto", "install_model", "start_model",
    "get_model_info", "start_request", "start_request_ids", "start_request_text", "get_wait", "get_request_status",
    "get_no_wait", "get_output_wait", "get_output_no_wait", "sync_request", "release_request", "stop_request",
    "reset_stream", "get_as_engine_stat", "get_free_frame", "get_op_profiling_info", "get_rank_id",
    "get_version_full", "is_allspark_work_as_service", "unload_device_mem", "load_device_mem", "save_model",
    "build_model_from_config_struct", "load_lora", "unload_lora", "stop_model", "release_model"]
SKIPPED: dict[str, str] = {}
OK, MISSING, NOT_RUN = "ok", "MISSING", "NOT RUN"
VERSION_FULL = re.compile(r"^\d+\.\d+\.\d+\S*/\(GitSha1:[^)]*\)/\(Build:[^)]*\)$")


class Missing(Exception):
    pass


class CheckFailed(AssertionError):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


class Reference:
    """The tiny model: its HF folder, transformers' model and tokenizer, a prompt, and transformers' answers."""

    def __init__(self, hf_dir: str, tokens: int, hf_model=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.hf_dir, self.tokens = hf_dir, tokens
        self.model = hf_model if hf_model is not None else AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.prompt = torch.randint(3, self.model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(7))
        self.prompt = self.prompt.tolist()
        self.text = "Hello world! Once upon a time"
        self.greedy = self.generate(self.prompt)
        self.text_greedy = self.generate(self.tokenizer.encode(self.text))

    def generate(self, ids: list[int]) -> list[int]:
        import torch
        x = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=self.tokens,
                                      min_new_tokens=self.tokens, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def make_adapter(self, work_dir: str) -> None:
        """A random LoRA adapter of the model (PEFT folder `adapter_dir`) and transformers + PEFT's greedy answer."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        torch.manual_seed(3)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(self.hf_dir),
                               LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])).eval()
        self.adapter_dir = os.path.join(work_dir, "adapter")
        model.save_pretrained(self.adapter_dir)
        base, self.model = self.model, model
        self.lora_greedy = self.generate(self.prompt)
        self.model = base

    def logprobs(self, ids: list[int], new: list[int]) -> list[float]:
        """log p(new[i] | ids + new[:i]) under transformers' model."""
        import torch
        with torch.no_grad():
            logits = self.model(torch.tensor([ids + new])).logits[0, len(ids) - 1:-1].double()
        return logits.log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()

    def dashinfer_config(self) -> dict:
        """The model_config DashInfer's HuggingFaceModel passes: the HF config dict plus its own keys."""
        cfg = self.model.config.to_dict()
        cfg.update(model_type="LLaMA_v3", size_per_head=cfg["hidden_size"] // cfg["num_attention_heads"],
                   rotary_emb_base=(cfg.get("rope_parameters") or cfg)["rope_theta"])
        return cfg


class EngineCheck:
    """Calls every method on one engine; rows: method -> ok / MISSING / FAILED: why."""

    def __init__(self, engine, label: str, ref: Reference, work_dir: str, world_size: int):
        from allspark_client import AsStatus, GenerateRequestStatus
        self.engine, self.label, self.ref, self.world_size = engine, label, ref, world_size
        self.dir = os.path.join(work_dir, label)
        self.name = f"compat-{label.lower()}"
        self.rows: dict[str, str] = {}
        self.current = ""
        self.S, self.G = AsStatus, GenerateRequestStatus
        self.greedy = {"top_k": 1, "max_new_tokens": ref.tokens, "eos_token_id": []}
        self.files: tuple[str, str] = ("", "")

    # ---- plumbing ------------------------------------------------------------------------------------------------
    def call(self, method: str, *args, deprecated: bool = False, **kwargs):
        fn = getattr(self.engine, method, None)
        if fn is None:
            self.rows[method] = MISSING
            raise Missing(method)
        self.current = method
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn(*args, **kwargs)
        warned = any(issubclass(w.category, DeprecationWarning) for w in caught)
        expect(warned == deprecated, f"{method}: DeprecationWarning {'missing' if deprecated else 'unexpected'}")
        self.rows.setdefault(method, OK)
        return out

    def status(self, method: str, *args, want=None, **kwargs):
        """A call that returns an AsStatus: it must be `want` (default: success)."""
        want = self.S.ALLSPARK_SUCCESS if want is None else want
        got = self.call(method, *args, **kwargs)
        expect(got == want, f"{method} returned {got!r}, expected {want!r}: {self.engine.get_last_error()}")

    def group(self, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Missing:
            return False
        except Exception as e:  # a failed check or call: recorded against the method called last
            self.rows[self.current] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return False

    def start(self, ids, gen=None, method: str = "start_request", *extra):
        if method == "start_request":
            st, handle, queue = self.call(method, self.name, {"input_ids": ids}, gen or self.greedy)
        else:
            st, handle, queue = self.call(method, self.name, *extra, gen or self.greedy)
        expect(st == self.S.ALLSPARK_SUCCESS, f"{method}: {st!r} {self.engine.get_last_error()}")
        return handle, queue

    def read(self, queue) -> list[int]:
        ids = []
        while (el := queue.Get()) is not None:
            ids += el.ids_from_generate
        return ids

    def run_greedy(self, name: str | None = None, gen: dict | None = None) -> list[int]:
        st, handle, queue = self.engine.start_request(name or self.name, {"input_ids": self.ref.prompt},
                                                      gen or self.greedy)
        expect(st == self.S.ALLSPARK_SUCCESS, f"start_request: {st!r} {self.engine.get_last_error()}")
        ids = self.read(queue)
        self.engine.release_request(name or self.name, handle)
        return ids

    def runtime_config(self, name: str, graph: str, params: str, profiling: bool = False):
        from allspark_client import AsModelRuntimeConfigBuilder
        return (AsModelRuntimeConfigBuilder().model_name(name).model_file_path(graph, params).compute_unit("cpu", [0])
                .max_length(2048).max_batch(4).kv_cache_span_size(16).profiling(profiling).build())

    # ---- the groups ----------------------------------------------------------------------------------------------
    def convert(self) -> None:
        from allspark_client import __version__
        from allspark_client._proto import allspark_pb2 as pb
        cfg = self.ref.dashinfer_config()
        out = self.call("serialize_model_from_torch", self.name, "LLaMA_v3", self.ref.model.state_dict(), cfg,
                        self.dir, data_type="float32", rotary_base=cfg["rotary_emb_base"])
        self.files = tuple(os.path.join(self.dir, self.name + ext) for ext in (".asgraph", ".asparam"))
        expect(out in (None, self.files) and all(map(os.path.isfile, self.files)), f"files: {out}")
        info = self.call("get_file_information", *self.files)
        expect(tuple(info) == (__version__,) * 3, f"get_file_information: {info}")
        graph = pb.ModelGraph()
        with open(self.files[0], "rb") as f:
            graph.ParseFromString(f.read())
        written = graph.build_meta.weight_hash
        graph.ClearField("build_meta")
        graph = self.call("dump_build_meta_to_proto", graph, self.files[1], {"model_type": "LLaMA_v3", "n": 1})
        with open(self.files[1], "rb") as f:
            md5 = hashlib.md5(f.read(32 << 20)).hexdigest()
        expect(graph.build_meta.weight_hash == md5 == written, "dump_build_meta_to_proto: weight hash")
        expect(dict(graph.build_meta.serialize_args) == {"model_type": "LLaMA_v3", "n": "1"}, "serialize_args")

    def lifecycle(self) -> None:
        self.status("install_model", self.runtime_config(self.name, *self.files, profiling=True))
        self.status("start_model", self.name)
        info = json.loads(self.call("get_model_info", self.name))
        expect(info["architecture"] == "LlamaForCausalLM" and info["world_size"] == self.world_size, str(info))

    def generation(self) -> None:
        ref, G = self.ref, self.G
        for method, extra in (("start_request", ()), ("start_request_ids", (None, ref.prompt))):
            handle, queue = self.start(ref.prompt, None, method, *extra)
            ids = self.read(queue)
            expect(ids == ref.greedy, f"{method}: {ids} != transformers' {ref.greedy}")
            self.status("release_request", self.name, handle)
        handle, queue = self.start(None, None, "start_request_text", ref.tokenizer, ref.text)
        expect(self.read(queue) == ref.text_greedy, "start_request_text: not transformers' greedy")
        self.status("release_request", self.name, handle)
        handle, queue = self.start(ref.prompt)                       # the deprecated ids-only readers
        ids = []
        while (got := self.call("get_wait", self.name, queue, deprecated=True)) is not None:
            ids += got
        expect(ids == ref.greedy, f"get_wait: {ids}")
        expect(self.call("get_request_status", self.name, queue, deprecated=True) == G.GenerateFinished, "status")
        expect(self.call("get_no_wait", self.name, queue, deprecated=True) is None, "get_no_wait after the end")
        self.status("release_request", self.name, handle)
        handle, queue = self.start(ref.prompt, {**self.greedy, "logprobs": True, "top_logprobs": 2})   # v1 outputs
        elements = []
        while (el := self.call("get_output_wait", self.name, queue)) is not None:
            elements.append(el)
        ids = [t for el in elements for t in el.ids_from_generate]
        lps = [lp for el in elements for lp in el.token_logprobs_list]
        expect(ids == ref.greedy, f"get_output_wait: {ids}")
        want = ref.logprobs(ref.prompt, ids)
        expect(max(abs(a - b) for a, b in zip(lps, want)) < 1e-3 and len(lps) == len(want), f"logprobs {lps} {want}")
        expect(self.call("get_output_no_wait", self.name, queue) is None, "get_output_no_wait after the end")
        self.status("sync_request", self.name, handle)
        self.status("release_request", self.name, handle)
        self.status("release_request", self.name, handle, want=self.S.ALLSPARK_ILLEGAL_REQUEST_ID)
        handle, queue = self.start(ref.prompt)
        self.status("sync_request", self.name, None)                 # every request of the model
        expect(queue.GenerateStatus() == G.GenerateFinished, "sync_request(None) returned before the end")
        self.status("release_request", self.name, handle)

    def long_request(self):
        handle, queue = self.start(self.ref.prompt, {**self.greedy, "max_new_tokens": 2000})
        expect(queue.Get() is not None, "no first token")
        return handle, queue

    def stopping(self) -> None:
        handle, queue = self.long_request()
        self.status("stop_request", self.name, handle)
        n = queue.GeneratedLength()
        time.sleep(0.2)
        expect(queue.GenerateStatus().is_terminal and queue.GeneratedLength() == n, "tokens after stop_request")
        self.status("release_request", self.name, handle)
        started = [self.long_request() for _ in range(2)]
        self.status("reset_stream", self.name, foo=1, want=self.S.ALLSPARK_PARAM_ERROR)
        self.status("reset_stream", self.name)
        for handle, queue in started:
            expect(queue.GenerateStatus().is_terminal, "a request still generates after reset_stream")
            self.status("release_request", self.name, handle)

    def information(self) -> None:
        stat = self.call("get_as_engine_stat", self.name)
        expect(stat.total_generated_token > 0 and stat.running_request == 0 and stat.free_span > 0, str(stat))
        layers = self.ref.model.config.num_hidden_layers
        frames = self.call("get_free_frame", self.name)
        expect(frames == self.engine.get_as_engine_stat(self.name).free_span * 2 * layers, f"frames {frames}")
        expect(self.call("get_rank_id") == 0, "get_rank_id")
        version = self.call("get_version_full")
        expect(bool(VERSION_FULL.match(version)), f"get_version_full: {version!r}")
        expect(self.call("is_allspark_work_as_service") is (self.label != "Engine"), "is_allspark_work_as_service")
        profile = self.call("get_op_profiling_info", self.name)      # installed with profiling on: every rank's table
        expect(isinstance(profile, str) and profile.count("(step)") == self.world_size, f"op profile:\n{profile}")

    def sleep_wake(self) -> None:
        before = self.run_greedy()
        self.call("unload_device_mem", self.name)
        self.call("load_device_mem", self.name)
        self.current = "load_device_mem"
        after = self.run_greedy()
        expect(before == after == self.ref.greedy, f"greedy before {before} / after {after} sleep")

    def lora(self) -> None:
        adapter = "compat-lora"
        self.status("load_lora", self.name, adapter, self.ref.adapter_dir)
        self.status("load_lora", self.name, adapter, self.ref.adapter_dir, want=self.S.ALLSPARK_LORA_ALREADY_LOADED)
        ids = self.run_greedy(gen={**self.greedy, "lora_name": adapter})
        expect(ids == self.ref.lora_greedy != self.ref.greedy, f"with the adapter: {ids}, transformers + PEFT: "
                                                               f"{self.ref.lora_greedy}, base: {self.ref.greedy}")
        self.status("unload_lora", self.name, adapter)
        self.status("unload_lora", self.name, adapter, want=self.S.ALLSPARK_LORA_NOT_FOUND)

    def save(self) -> None:
        saved, second = os.path.join(self.dir, "saved"), self.name + "-saved"
        self.status("save_model", self.name, saved, is_text_graph=True, want=self.S.ALLSPARK_PARAM_ERROR)
        self.status("save_model", self.name, saved)
        files = [os.path.join(saved, self.name + ext) for ext in (".asgraph", ".asparam")]
        with open(files[1], "rb") as a, open(self.files[1], "rb") as b:
            expect(a.read() == b.read(), "save_model: the .asparam differs from the installed one")
        self.status("build_model_from_config_struct", self.runtime_config(second, *files), deprecated=True)
        self.engine.start_model(second)
        try:
            ids = self.run_greedy(second)
            expect(ids == self.ref.greedy, f"the saved model answers {ids}")
        finally:
            self.status("stop_model", second)
            self.status("release_model", second)

    def run(self) -> dict[str, str]:
        installed = False
        if self.group(self.convert):
            installed = self.group(self.lifecycle) or self.rows.get("install_model") == OK
        if installed:
            for fn in (self.generation, self.stopping, self.information, self.sleep_wake, self.lora, self.save):
                self.group(fn)
            self.group(lambda: (self.status("stop_model", self.name), self.status("release_model", self.name)))
        rows = {m: self.rows.get(m) or (NOT_RUN if hasattr(self.engine, m) else MISSING) for m in METHODS}
        return {**rows, **SKIPPED}


def run_all(engines: dict, ref: Reference, work_dir: str, world_sizes: dict) -> dict[str, dict[str, str]]:
    """{label: {method: result}} for each engine."""
    ref.make_adapter(work_dir)
    return {label: EngineCheck(engine, label, ref, work_dir, world_sizes[label]).run()
            for label, engine in engines.items()}


def table(results: dict[str, dict[str, str]]) -> str:
    labels = list(results)
    methods = list(next(iter(results.values())))
    width = max(map(len, methods))
    lines = [f"{'method':<{width}}  " + "  ".join(f"{label:<14}" for label in labels)]
    for m in methods:
        lines.append(f"{m:<{width}}  " + "  ".join(f"{results[label][m]:<14}" for label in labels))
    return "\n".join(lines)


def all_ok(results: dict[str, dict[str, str]]) -> bool:
    return all(r == OK or r in SKIPPED.values() for rows in results.values() for r in rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the pool this script spawns")
    p.add_argument("--address", help="use the running pool at this address instead of spawning one")
    p.add_argument("--engine-only", action="store_true", help="check the in-process Engine only")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per request")
    a = p.parse_args()
    logging.getLogger("allspark").setLevel(logging.ERROR)      # the refusals this script provokes are logged too

    from allspark_client import ClientEngine
    from allspark_server import Engine
    from allspark_server.loader.tiny_model import build_tiny_model
    with tempfile.TemporaryDirectory(prefix="allspark-compat-") as work:
        hf_dir = os.path.join(work, "hf")
        build_tiny_model(hf_dir, "llama_gqa_llama3", seed=0)
        ref = Reference(hf_dir, a.tokens)
        engines, sizes = {"Engine": Engine()}, {"Engine": 1}
        if not a.engine_only:
            client = ClientEngine(a.address) if a.address else ClientEngine(ranks=a.ranks)
            engines["ClientEngine"], sizes["ClientEngine"] = client, client.health.world_size
        try:
            results = run_all(engines, ref, work, sizes)
        finally:
            for engine in engines.values():
                engine.close()
    print(table(results))
    raise SystemExit(0 if all_ok(results) else 1)


if __name__ == "__main__":
    main()
