"""Session fixtures: tiny HF models (built once, locally) and their serialized allspark files."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(__file__))
logging.getLogger("allspark").setLevel(logging.ERROR)

from allspark_server.tiny_model import VARIANTS, build_tiny_model  # noqa: E402


@dataclass
class TinyModel:
    variant: str
    hf_dir: str
    model: object          # the transformers model, fp32, eval mode


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
    from helpers import serialize, start_engine
    loader = serialize(llama.hf_dir, "llama", str(tmp_path_factory.mktemp("as")))
    engine = start_engine(loader, "llama", max_batch=8, max_length=1024)
    yield engine, loader
    engine.sync_request("llama")


@pytest.fixture(scope="session")
def pool(llama, tmp_path_factory):
    """A real 2-rank pool (mpirun via allspark-launch), reached through ClientEngine, serving the
    GQA Llama model as 'llama'. Shared by the whole session: tests release what they start."""
    from allspark_client import ClientEngine
    from helpers import serialize
    loader = serialize(llama.hf_dir, "llama", str(tmp_path_factory.mktemp("pool")))
    client = ClientEngine(ranks=2)
    cfg = (loader.create_reference_runtime_config_builder("llama", "cpu", [0], max_batch=8)
           .max_length(1024).kv_cache_span_size(16).build())
    client.install_model(cfg)
    client.start_model("llama")
    yield client, loader
    client.close()
