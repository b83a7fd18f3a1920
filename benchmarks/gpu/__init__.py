"""The GPU check: ``check`` runs the steps and writes the report, ``measure`` times K-FAC against SGD on the
device, ``report`` lays out ``gpu-report.json`` / ``.md`` and evaluates the targets."""

from benchmarks.gpu.check import main

__all__ = ["main"]
