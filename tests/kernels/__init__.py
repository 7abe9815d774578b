"""Tests of mxfp4conv/kernels/."""
