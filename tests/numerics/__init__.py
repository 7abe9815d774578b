"""Tests of mxfp4conv/numerics/."""
