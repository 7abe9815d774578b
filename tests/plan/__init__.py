"""Tests of mxfp4conv/plan/."""
