"""The CUDA backend: what `allspark_server.compute.ops` runs when a rank's tensors live on a GPU.

`compute/ops.py` stays the one door to compute; each of its ops hands CUDA tensors to the op of the same name in
`cuda/cuda_ops.py` (cuBLAS through torch and Triton GEMVs for linear layers, Triton kernels for attention over the
span cache and the elementwise ops; `pdl.py` lets the decode step's kernels overlap). Nothing here is imported
on a CPU-only rank.
"""
