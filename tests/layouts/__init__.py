"""One test module per input layout (mxfp4conv/layouts/)."""
