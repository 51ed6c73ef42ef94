"""Built-in adapters (torch.nn, transformers-style fused layers by class path) and user helpers."""
