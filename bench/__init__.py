"""The benchmarks, built with the core at the repository's root: every figure a ratio measured in one run, each run
from the repository's root as `python -m bench.NAME` (`overhead`: the CPU table; `host`: the host's work per call at
real depth; `gpu`: images/s and MFU at real width; `check`: the GPU tier in one command). BENCHMARKS.md holds what
they measured."""
