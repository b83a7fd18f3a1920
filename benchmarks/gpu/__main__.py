"""``python -m benchmarks.gpu``: the GPU check (``benchmarks/gpu/check.py``)."""

from benchmarks.gpu import main

raise SystemExit(main())
