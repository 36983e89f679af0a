"""A rank of the peer-memory allreduce test (test_triton_peer_allreduce.py), run in its own process: its kernels
spin on flags that the other ranks' processes raise, so the ranks must run at the same time (the Triton
interpreter is not thread-safe)."""
import os

os.environ["TRITON_INTERPRET"] = "1"


def run_rank(rank: int, world: int, buffers: list, slot_bytes: int, inputs: list, outputs: list,
             protocol: str) -> None:
    """Allreduce each of this rank's `inputs` in turn (CPU tensors: the interpreter's memory is this process's),
    writing the results into the shared `outputs`; `buffers`: every rank's shared buffer, mapped here. An input
    (x, residual, weight, eps) takes allreduce_norm, then the plain call and fused_kernels.rms_norm on its result:
    its output the triple (normed, residual stream, the plain call's normed)."""
    import torch
    torch.set_num_threads(1)
    from triton_interpreter import skip_repatching

    from allspark_server.compute.cuda.fused_kernels import rms_norm
    from allspark_server.compute.cuda.peer_allreduce import PeerAllreduce
    skip_repatching()
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)   # this process's mappings
    peer = PeerAllreduce(addresses, rank, world, slot_bytes, protocol=protocol)
    for x, out in zip(inputs, outputs):
        if isinstance(x, tuple):
            x, residual, weight, eps = x
            y = x.clone()
            normed, stream = peer.allreduce_norm(y, residual, weight, eps)
            assert torch.equal(y, x), "allreduce_norm changed its input"
            out[0].copy_(normed)
            out[1].copy_(stream)
            out[2].copy_(rms_norm(peer.allreduce_(y), weight, eps, residual)[0])
            continue
        y = x.clone()
        assert peer.allreduce_(y) is y
        out.copy_(y)
    outputs[-1].copy_(torch.cat([peer.slot, peer.done]).to(outputs[-1].dtype))


def check_rank(rank: int, world: int, buffers: list, slot_bytes: int, protocol: str, result) -> None:
    """peer_allreduce.self_check on this rank, its answer into the shared `result` [1]."""
    import torch
    torch.set_num_threads(1)
    from triton_interpreter import skip_repatching

    from allspark_server.compute.cuda.peer_allreduce import PeerAllreduce, self_check
    skip_repatching()
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    peer = PeerAllreduce(addresses, rank, world, slot_bytes, protocol=protocol)
    result[0] = int(self_check(peer, torch.device("cpu")))
