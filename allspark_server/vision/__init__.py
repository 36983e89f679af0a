"""The vision side of Qwen2-VL / Qwen2.5-VL, independent of the engine: the vision transformer (encoder.py, its
blocks in blocks.py, patch geometry in geometry.py, its settings in tower_config.py, its tensors in
checkpoint.py), the 3-D rotary positions of a prompt (mrope.py), and images plus a chat turned into the model's
inputs (processor.py, images decoded and checked in image_files.py)."""
