"""`python -m bench.gpu` (what scripts/gpu-check runs): see bench/gpu/check.py."""

from .check import main

raise SystemExit(main())
