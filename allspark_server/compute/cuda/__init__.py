"""The CUDA backend: what `allspark_server.compute.ops` runs when a rank's tensors live on a GPU.

`compute/ops.py` stays the one door to compute; each of its ops hands CUDA tensors to the op of the same name in
`cuda/cuda_ops.py` (cuBLAS through torch and Triton GEMVs for linear layers, Triton kernels for attention over the
span cache and the elementwise ops; `pdl.py` lets the decode step's kernels overlap). A GPU rank's device kind
(`cuda_device.py`: what differs from a CPU rank, and the choice of the rank's GPU) reaches the rest of CUDA the
rank uses outside the kernels: the decode graphs' capture (`graph_capture.py`) and the pinned host memory of a
sleeping rank's weights (`host_arena.py`). Nothing here is imported on a CPU-only rank.
"""
