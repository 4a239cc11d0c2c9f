"""Build hook for the native helpers in csrc/ (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._native",
            sources=["csrc/native.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
