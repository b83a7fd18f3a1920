"""Reading a profile file as data, with bounds: a size cap, a cap on what aliases may expand to, and numbers
read as numbers.

A profile comes from elsewhere (another cluster, a paper, a colleague), so it is parsed, never trusted:

* the file may hold at most :data:`MAX_BYTES`;
* YAML aliases are resolved by reference, but a document whose aliases would expand past
  :data:`MAX_NODES` values (the "billion laughs" shape: ``a: [*b, *b, ...]`` nested) is refused before
  anything is built from it, in one line;
* ``2e-2``, ``1E3`` and ``5.`` are numbers (YAML 1.2's float syntax; PyYAML's YAML 1.1 reads an exponent
  without a dot as a string).

Errors are :class:`~kfac_bench.errors.ConfigError`, one line naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kfac_bench.errors import ConfigError

__all__ = ["MAX_BYTES", "MAX_NODES", "load_yaml"]

#: Largest profile file read (bytes): a profile is a few dozen values with their sources.
MAX_BYTES = 1 << 20
#: Most values a document may hold once its aliases are expanded.
MAX_NODES = 100_000

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader with YAML 1.2 floats (its own resolver table: the global one is left as it is)."""

    # add_implicit_resolver copies the inherited table into the subclass before adding to it.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def _expanded_size(root: Any) -> int:
    """Values in the document with every alias expanded, counted in time linear in its nodes (a node seen
    twice through aliases counts its whole size again, as expanding would)."""
    import yaml

    sizes: dict[int, int] = {}
    # Post-order walk without recursion (a deep document cannot overflow the stack).
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            sizes[key] = 1
            continue
        if done:
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_NODES:
                return sizes[key]
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def load_yaml(path: Path, label: str) -> Any:
    """The document in ``path`` (``label`` names it in errors, e.g. ``plan.profile_file=x.yaml``).

    Raises:
        ConfigError: too large, unreadable, invalid YAML, or aliases that expand past :data:`MAX_NODES`.
    """
    import yaml

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{label}: cannot be read ({err.strerror})") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(
            f"{label}: larger than {MAX_BYTES // 1024} KiB; a profile is a few dozen values"
        )
    try:
        text = data.decode("utf-8")
        loader = _loader()(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            size = _expanded_size(node)
            if size > MAX_NODES:
                raise ConfigError(
                    f"{label}: its aliases expand to more than {MAX_NODES:,} values; write the "
                    "values out (a profile needs no aliases)"
                )
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{label}: not a readable YAML file ({first})") from None
    except RecursionError:
        raise ConfigError(f"{label}: nested too deeply to be a profile") from None
