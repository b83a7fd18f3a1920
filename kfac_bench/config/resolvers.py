"""OmegaConf resolvers used by kfac-bench's configs, registered when this module is imported.

``${uid:}`` is a short random suffix, the same everywhere in one config (OmegaConf caches it, and Hydra
copies the cache into every sweep job's config): ``configs/train.yaml`` appends it to the generated run and
sweep directory names, so two runs started in the same second never share a directory.

A submitit sweep job composes its config in a fresh process on the cluster node; the Hydra task function
references :func:`register_resolvers`, so unpickling it imports this module and the resolver exists there
before Hydra resolves the job's directory.
"""

from __future__ import annotations

import secrets

from omegaconf import OmegaConf

__all__ = ["register_resolvers", "unique_suffix"]


def unique_suffix() -> str:
    """Six random hex digits (16.7 million values)."""
    return secrets.token_hex(3)


def register_resolvers() -> None:
    """Register ``uid`` (idempotent)."""
    if not OmegaConf.has_resolver("uid"):
        OmegaConf.register_new_resolver("uid", unique_suffix, use_cache=True)


register_resolvers()
