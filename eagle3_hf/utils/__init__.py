"""Helpers below every other layer: whole-or-nothing writes and output checks, precision
and dtype resolution, Hub ids, shims over transformers versions. Imports nothing else of eagle3_hf.
"""
