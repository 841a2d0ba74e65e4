"""Measurement: benchmarks, the cross-compiled survey of other GPUs and the recorded results.
"""
