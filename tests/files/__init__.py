"""Tests of mxfp4conv/files/."""
