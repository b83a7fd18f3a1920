"""The engine stands alone: importing it loads no Hydra, OmegaConf or harness module."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_imports_only_torch_and_stdlib() -> None:
    code = (
        "import json, sys; import kfac_bench.kfac; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'hydra', 'omegaconf', 'transformers', 'torchvision'} "
        "or (m.startswith('kfac_bench.') and not m.startswith('kfac_bench.kfac')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
