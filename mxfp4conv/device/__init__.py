"""The CUDA driver's start, pinned host buffers, device tensors written out to shards."""
