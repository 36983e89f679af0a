"""When the GPU kernels launch with programmatic dependent launch (allspark_server/cuda/pdl.py): only compiled
kernels on a GPU of compute capability 9.0 or newer, and never with ALLSPARK_PDL=0. (Whether kernels so launched
give the same bits is tests/gpu/test_cuda.py's, on a GPU.)"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from allspark_client import settings

pytest.importorskip("triton")

from allspark_server.compute.cuda import pdl

GPU = torch.device("cuda", 0)


@pytest.mark.parametrize("major,env,interpreted,expected", [
    (9, None, False, True), (10, "1", False, True),            # Hopper and newer, compiled: on
    (8, None, False, False),                                   # Ampere has no griddepcontrol
    (9, "0", False, False),                                    # switched off
    (9, None, True, False),                                    # the interpreter
])
def test_launch_options(monkeypatch, major, env, interpreted, expected):
    pdl._capable.cache_clear()
    monkeypatch.setattr(pdl, "_INTERPRETED", interpreted)
    with settings.override(PDL=env), mock.patch.object(torch.cuda, "get_device_capability", return_value=(major, 0)):
        assert pdl.enabled(GPU) is expected
        assert pdl.launch_options(GPU) == ({"PDL": True, "launch_pdl": True} if expected else {"PDL": False})
    pdl._capable.cache_clear()


def test_cpu_tensors_never_use_it(monkeypatch):
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
