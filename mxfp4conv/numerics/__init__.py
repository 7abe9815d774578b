"""NVFP4 requantized to MXFP4, units canonicalized, and the units of a plan transformed in order."""
