# Two entry points (README, Quick start): `make train` and `make test`. Each sets up .venv first.
#
# The venv sees the system's site-packages, so a CUDA torch already on the machine is kept.
# Without any torch, `pip install torch==$(TORCH_VERSION)` installs it (on the CPU machines this
# project is developed on, that resolves to a CPU wheel; never the multi-GB CUDA wheels).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup peers train train-link bench-link test test-oldest test-gpu gpu-wheels

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	@$(BIN)/python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
	touch $@

# The real peers bench.peers compares against (a bench extra): torchtitan 0.3.0 without its dependencies
# (its trainer's: datasets, wandb, torchdata, ...) plus what its MoE modules import, and DeepSpeed with no
# op builds (pure Python on torch's CPU wheel), into $(VENV)/peers: beside the venv's packages, not among
# them (bench.peers.layers puts it on sys.path), so a transformers.Trainer in the venv does not import DeepSpeed.
# About 30 s; `make test` installs them so the peers' equality tests run in CI. Output in
# $(VENV)/peers.log, shown on failure.
PEERS_STAMP := $(VENV)/.peers-dir
peers: $(PEERS_STAMP)

# $(1): the venv whose peers/ folder gets them.
define install_peers
	@echo "installing the peers into $(1)/peers (torchtitan 0.3.0 without its trainer's dependencies, DeepSpeed 0.19.8 without op builds; log: $(1)/peers.log)"
	@rm -rf $(1)/peers
	@( $(1)/bin/python -m pip uninstall -y -q torchtitan deepspeed spmd_types \
	  && DS_BUILD_OPS=0 $(1)/bin/python -m pip install -q --no-deps --target $(1)/peers torchtitan==0.3.0 spmd_types==0.2.3 deepspeed==0.19.8 \
	  && $(1)/bin/python -m pip install -q --target $(1)/peers tyro einops hjson msgpack ninja py-cpuinfo pydantic ) > $(1)/peers.log 2>&1 \
	  || { cat $(1)/peers.log; exit 1; }
	@$(1)/bin/python -c "import bench.peers.layers as p, torchtitan.models.common.moe, deepspeed; print('peers: torchtitan 0.3.0 | deepspeed', deepspeed.__version__, 'in', p.PEERS_DIR)"
endef

$(PEERS_STAMP): $(VENV)/.installed
	$(call install_peers,$(VENV))
	@touch $@

# The main job (examples/train_lm.py): a GPT-style MoE language model, 2 expert-parallel ranks, under
# lancet_rt.Overlapped.
train: setup
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_lm.py

# The main job over a real link (root; iproute2): 2 ranks, each in its own network namespace, every port
# token-bucket limited at LINK_RATE (bench.reallink), the expert-parallel group split; prints sequential vs
# overlapped tokens/s.
LINK_RATE ?= 250mbit
TRAIN_LINK_ARGS ?= --steps 100 --timing-steps 10
train-link: setup
	$(BIN)/python -m bench.reallink --ranks 2 --rate $(LINK_RATE) -- -m examples.train_lm --channels split $(TRAIN_LINK_ARGS)

# The real-link acceptance (root; minutes): bench.overlap --link real on the blocks model (2 and 4
# ranks) and Mixtral, rate calibrated to comm = 1x compute, with the peers (make peers); prints the table and
# appends out/overlap_real.json (untracked; BENCH_LINK_ARGS="--json bench/results/overlap_real.json" for the project's rows).
bench-link: setup peers
	$(BIN)/python -m bench.reallink.acceptance $(BENCH_LINK_ARGS)

# The test suite (CPU lane; Triton kernels in the interpreter); its header states the versions it ran
# with. Exit code 5 (no tests) is not a failure. TEST_WORKERS pytest-xdist processes (default 2: the
# suite spends a fifth of its time waiting on ranks and commands it starts; each file runs in one
# worker, so a file's module fixtures are made once); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
TEST_ARGS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: setup peers
	$(BIN)/python -m pytest $(TEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The suite on pyproject.toml's lower bounds, pinned (tests/lower_bounds.py turns every `name>=X` into
# `name==X`) in a venv of their own, with the peers: the oldest supported set is a tested one. `make
# test` runs the newest that resolves today. Minutes: a fresh venv, then the whole suite.
OLDEST := .venv-oldest
test-oldest:
	rm -rf $(OLDEST)
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q "tomli; python_version < '3.11'"
	$(OLDEST)/bin/python -m tests.lower_bounds > $(OLDEST)/constraints.txt
	$(OLDEST)/bin/python -m pip install -q -c $(OLDEST)/constraints.txt -e ".[test,bench]"
	$(call install_peers,$(OLDEST))
	$(OLDEST)/bin/python -m pytest -p no:cacheprovider $(TEST_ARGS) $(OLDEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The GPU lane, on a CUDA machine.
test-gpu: setup
	$(BIN)/python -m pytest -m gpu -q

# What the lent GPU machine lacks of the lane's needs (it has no package registry): greenlet and xxhash; its
# image has torch, triton, nvidia-ml-py, safetensors, tqdm, pytest, pytest-timeout, transformers and
# matplotlib (../shared/GPU.md). Carried as .whl/ (ignored by git; `carry: [".whl"]`), installed by
# bench.lane into a temporary directory. GPU_PYTHON is that machine's Python version.
GPU_PYTHON ?= 3.12
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl greenlet==3.5.6 xxhash==3.6.0
	@ls .whl
