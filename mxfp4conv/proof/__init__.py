"""The proof: the inline post-write check, verify, and the manifest they prove an output against."""
