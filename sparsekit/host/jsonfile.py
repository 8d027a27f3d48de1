"""JSON files read with one-line errors: a file that is not UTF-8, not JSON, not an object, or cannot
be read is one ``SparsekitError`` naming it (a binary ``config.json`` was a ``UnicodeDecodeError``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparsekit.errors import SparsekitError


def read_json_object(path: str | os.PathLike, fix: str = "fix or remove it") -> dict[str, Any]:
    """The JSON object in ``path`` as a dict; anything else is one line ending with ``fix``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SparsekitError(f"{path} is not valid JSON (not UTF-8 text: byte {e.start}): {fix}") from None
    except ValueError as e:
        raise SparsekitError(f"{path} is not valid JSON ({e}): {fix}") from None
    except OSError as e:
        raise SparsekitError(f"cannot read {path} ({e.strerror or type(e).__name__}): check the file and its "
                             "permissions") from None
    if not isinstance(data, dict):
        raise SparsekitError(f"{path} is not a JSON object: {fix}")
    return data
