"""Every kind of source: a local folder, a Hugging Face repo (its cache or read by range), a GGUF output."""
