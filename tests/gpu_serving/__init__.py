"""vLLM 0.33's GPU build serving ``--to marlin`` outputs through the plugin (docs/serving-marlin.md §8).

``bundle.py`` (``make gpu-bundle``) prepares what a GPU machine without network access needs:
vLLM 0.33.0's Python tree, its two stable-ABI libraries with the machine code of other GPU
architectures zeroed (``fatbin.py``) and xz-compressed, the pure-Python dependencies of the offline
engine (``pins.txt``) and an mxfp4conv wheel. ``unpack.py`` unpacks it there, ``engine.py`` is the
engine's process, ``tests/vllm_plugin/test_vllm_gpu_serving.py`` the test.
"""
