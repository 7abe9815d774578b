"""End-to-end tests through the command line (mxfp4conv/cli.py): exit codes, whole conversions, golden outputs."""
