"""Torch-free serving core: request state, span (KV page) manager, scheduler and step messages."""
