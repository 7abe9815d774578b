"""One test module per output target (mxfp4conv/targets/)."""
