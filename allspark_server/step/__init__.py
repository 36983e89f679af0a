"""What one model step reads besides the weights: its forward inputs (ids, positions, attention metadata built from
a StepPlan) and the KV cache tensors (span pages per layer, dense or quantized, on huge pages where possible)."""
