"""Reading HF checkpoints, writing and reading allspark model files, and per-rank sharding."""
