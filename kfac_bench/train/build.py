"""Config -> objects: Hydra instantiation that reports a builder's user errors in one line, and the data
contract check."""

from __future__ import annotations

from typing import Any

from kfac_bench.data.base import DataSplits
from kfac_bench.errors import UserError

__all__ = ["build_data", "instantiate"]


def instantiate(cfg: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (containers as plain Python), re-raising a builder's
    :class:`~kfac_bench.errors.UserError` as itself so the CLI reports it in one line."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(cfg, _convert_="all", **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, UserError):
            raise exc.__cause__ from None
        raise


def build_data(dataset_cfg: Any) -> DataSplits:
    """Both splits of a ``dataset`` config: its builder returns a :class:`DataSplits`.

    Raises:
        TypeError: the builder returned something else (a programming error, not a user's).
    """
    splits = instantiate(dataset_cfg)
    if not isinstance(splits, DataSplits):
        raise TypeError(
            f"dataset builder {dataset_cfg._target_} returned {type(splits).__name__}; "
            "every dataset builder returns kfac_bench.data.base.DataSplits"
        )
    return splits
