"""Tests of mxfp4conv/proof/."""
