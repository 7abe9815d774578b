"""Tests of mxfp4conv/run/."""
