"""Files and their bytes: safetensors shards read and written, the byte sources they read through, hashing, the C build."""
