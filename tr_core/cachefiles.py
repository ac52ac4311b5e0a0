"""Writing the per-machine cache files (calibrations, kernel timings) so that processes sharing a machine, such as the
benchmark's workers on a local Ray, never read half a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str | bytes) -> None:
    """Write ``text`` (str or bytes) to ``path`` (its folder made if missing) through a temporary file beside it and
    a rename: a reader sees the old file or the new one, never a part of either."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.chmod(temporary, 0o644)  # as a plain write leaves it (mkstemp's file is the owner's alone)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
