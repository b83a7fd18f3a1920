"""Reading one image file: a file that cannot be decoded stops the run with one line naming it. Writing
one (the tiny datasets' generators): through :func:`kfac_bench.safe_files.write_atomic`.

torchvision's ``ImageFolder`` and ``CocoDetection`` neither skip nor name a bad file: a truncated JPEG raises
PIL's ``OSError: image file is truncated`` from deep inside the loader, mid-run, without the path (and a
``DataLoader`` worker wraps it in a traceback). The reference loaders do not skip either, and skipping would
change the epoch's examples without notice, so :func:`load_rgb` (the loader of both readers here) raises
:class:`ImageReadError` naming the file, which the CLI prints as one line with exit status 2. It survives
the trip out of a ``DataLoader`` worker as the same one line.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kfac_bench.errors import DatasetError

__all__ = ["ImageReadError", "load_rgb", "write_jpeg"]

#: What PIL raises for a file it cannot decode: truncated or corrupt data (OSError, UnidentifiedImageError),
#: a broken header (SyntaxError, ValueError), a decompression bomb.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
_WORKER_PREFIX = "Caught ImageReadError "


class ImageReadError(DatasetError):
    """An image file of the dataset that is missing or cannot be decoded (one line naming the file)."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        if message.startswith(_WORKER_PREFIX):
            # Re-raised by DataLoader from a worker as "Caught ... Original Traceback ...": the last line is
            # "kfac_bench.data.images.ImageReadError: <the worker's message>".
            last = message.rstrip().splitlines()[-1]
            message = last.split(": ", 1)[1] if ": " in last else last
        Exception.__init__(self, message)
        self.path = path


def load_rgb(path: str | os.PathLike[str]) -> Image.Image:
    """The image at ``path`` as RGB (torchvision's ``pil_loader``), decoded now.

    Raises:
        ImageReadError: the file is missing, truncated or not an image.
    """
    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert("RGB")
    except FileNotFoundError:
        raise ImageReadError(
            f"image file {Path(path)} is missing; restore it from the dataset's source", path
        ) from None
    except _DECODE_ERRORS as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageReadError(
            f"cannot decode image file {Path(path)} ({reason}): it is truncated or not an image; "
            "restore it from the dataset's source (re-download or re-extract)",
            path,
        ) from None


def write_jpeg(path: Path, pixels: np.ndarray, **options: Any) -> None:
    """Write ``pixels`` (``(H, W, 3)`` uint8) as a JPEG at ``path`` with PIL's save ``options``, atomically
    and following no link planted at that name (:func:`kfac_bench.safe_files.write_atomic`)."""
    from kfac_bench import safe_files

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", **options)
    safe_files.write_atomic(path, buf.getvalue())
