# Two commands are the whole set-up on a fresh clone:
#   make demo   # builds .venv from the pinned requirements, then runs the main demo
#   make test   # builds .venv from the pinned requirements, then runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mla-ops-installed

# Never let torch_npu auto-load on a machine without CANN (it breaks `import torch`).
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: venv test test-fast lint demo clean

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
