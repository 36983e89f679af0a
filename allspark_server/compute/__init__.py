"""The one door to compute: `ops` (each op with a torch reference, the native CPU kernels behind it) and the CUDA
backend (`cuda/`) that the same op names reach for GPU tensors."""
