"""Model architectures (plain PyTorch, one file each) and the registry keyed by HF architectures[0]."""
