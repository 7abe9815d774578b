"""A conversion run: staging, the shards written and checked, the model card, the atomic publish into DST."""
