"""Per-rank execution: forward inputs from a StepPlan, KV cache tensors, the model runner, the sampler."""
