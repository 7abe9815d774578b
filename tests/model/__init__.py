"""Tests of mxfp4conv/model/."""
