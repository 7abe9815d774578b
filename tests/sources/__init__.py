"""Tests of mxfp4conv/sources/."""
