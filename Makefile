# `make test` works on a fresh machine: it creates .venv, installs torch (the CPU build
# where no NVIDIA GPU is visible, the default CUDA build where one is), installs this
# project with its dev extras, then runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch 2.13.0 is the CPU build on machines without a GPU (a local wheel here); an unpinned
# torch would pull several GB of CUDA packages.  Override with `make TORCH_SPEC=...`.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo torch; else echo torch==2.13.0; fi)
STAMP  := $(VENV)/.installed
# What the targets below need installed first; `make gpu PY=python3 INSTALL=` runs them with a
# Python that already has everything (a machine without a package registry: docs/executor.md).
INSTALL ?= $(STAMP)

.PHONY: install test test-all bench demo reproduce encodings recompute realmodels gpu gpu-bench gpu-window clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The suite runs in worker processes (pytest-xdist: one per core, at most 4; a module's tests
# in one worker, so its fixtures are built once), each torch on one thread: threads of
# several workers spinning on two cores cost more than they bring (on this project's 2-core
# machine: 1 min 46 s, against 3 min 20 s in one process with torch's threads, 2026-11-28).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test: $(INSTALL)
	$(PYTEST)

# the slow variants too (ResNet-18 gradient tests)
test-all: $(INSTALL)
	OFFLOAD_HYPOTHESIS=explore $(PYTEST) -m ""

bench: $(INSTALL)
	$(PY) -m experiments.bench_solver
	$(PY) -m experiments.bench_profiler
	$(PY) -m experiments.bench_overhead
	$(PY) -m experiments.casts --train
	$(PY) -m experiments.options --bandwidth 0.5GB/s
	$(PY) -m experiments.moved_checkpoints --bandwidth 0.5GB/s
	$(PY) -m experiments.held_parts
	$(PY) -m experiments.shared_checkpoints --bandwidth 0.5GB/s
	@# the executor's benchmark needs a GPU to mean anything (on a CPU its copies are memcpy)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then $(PY) -m experiments.bench_executor; \
	else echo "no CUDA GPU: skipping experiments.bench_executor (make gpu-bench runs its smoke set on a CPU)"; fi

# The whole pipeline on the CPU in a few minutes: profile, sweep, plot, solve, train (outputs in demo/).
demo: $(INSTALL)
	$(PY) -m experiments.demo --out demo

# The makespan-vs-budget reproduction on the committed zoo chains (experiments/results/reproduction/).
reproduce: $(INSTALL)
	$(PY) -m experiments.reproduce

# Hugging Face models, and models that are not chains (T5, U-Net, MoE, frozen backbone), end to end: profile,
# solve at half the peak, train bit-exact (experiments/results/realmodels/).
realmodels: $(INSTALL)
	$(PY) -m experiments.realmodels
	$(PY) -m experiments.realmodels --set non-chains
	$(PY) -m experiments.realmodels --set decoders

# Encoding + offloading vs offloading alone on the zoo CNNs (experiments/results/encodings/).
encodings: $(INSTALL)
	$(PY) -m experiments.encodings

# Recomputation + offloading vs either alone on the zoo chains (experiments/results/recompute/).
recompute: $(INSTALL)
	$(PY) -m experiments.recompute

# The executor host time per storage copied (batched, and one call per storage), then the executor
# benchmark: a conv net, an fp32 and a bf16 transformer at 30/50/70% of their peak,
# offload-only, joint and per-block checkpointing, with no offloading and save_on_cpu beside:
# predicted vs measured step and peak, overlap, gradients, exit codes (experiments/results/
# executor-<device>/summary.md).  On a machine without a GPU it runs its smoke sizes.
gpu-bench: $(INSTALL)
	$(PY) -m experiments.bench_overhead --copies
	$(PY) -m experiments.bench_executor
	$(PY) -m experiments.compiled --model llama

# Everything only a GPU can show, in one command on a machine with one: the executor benchmark,
# GPU-measured zoo chains, the reproduction and the encodings experiment re-run on them, then the
# GPU tests.  Results land under experiments/.
gpu: $(INSTALL)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu: torch sees no CUDA GPU here')"
	$(PY) -m experiments.bench_overhead --copies
	$(PY) -m experiments.bench_executor
	$(PY) -m experiments.compiled --model llama
	$(PY) -m experiments.profile_zoo --device cuda
	$(PY) -m experiments.realmodels --set non-chains --device cuda --out experiments/results/realmodels-cuda
	$(PY) -m experiments.reproduce
	$(PY) -m experiments.encodings
	$(PY) -m pytest -q -m "gpu or cudashim" tests/test_executor_gpu.py tests/test_cudashim.py

# One device window (under 10 minutes on an H100/H200): what is still to be measured on a GPU,
# each part under its own limit (experiments/gpu_window.sh says which); results under $(GPU_OUT),
# at most 8 files (a device run passes GPU_OUT=$$OUT).
GPU_OUT ?= experiments/results/executor-cuda/window
gpu-window: $(INSTALL)
	bash experiments/gpu_window.sh $(GPU_OUT) $(PY)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis demo
