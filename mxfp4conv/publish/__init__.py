"""Beyond one run: the output pushed to the Hugging Face Hub, partitions run as Ray tasks."""
