"""Sweeps, plots, the paper-style reproduction and the benchmarks."""
