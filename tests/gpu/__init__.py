"""Tests of herd on NVIDIA GPUs (see conftest.py)."""
