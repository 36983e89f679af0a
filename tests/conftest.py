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
