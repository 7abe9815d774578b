"""Tests of mxfp4conv/publish/."""
