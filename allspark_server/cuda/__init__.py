"""The CUDA backend: what `allspark_server.ops` runs when a rank's tensors live on a GPU.

`ops.py` stays the one door to compute; each of its ops hands CUDA tensors to the op of the same name in
`cuda/ops.py` (cuBLAS through torch for linear layers, Triton kernels from `attention_kernels.py` for
attention over the span cache). Nothing here is imported on a CPU-only rank.
"""
