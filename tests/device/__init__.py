"""Tests of mxfp4conv/device/."""
