"""The prefixes of the lines that carry a measuring job's answer in its output. Apart from the
jobs that print them (which import torch) so that the launcher reading them never does."""

SCALING = "HERD_SCALING "
"""The scaling job's rank 0: its measured throughput, one JSON object after the prefix."""
