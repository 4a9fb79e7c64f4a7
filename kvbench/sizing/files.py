"""Reading the TOML files kvbench takes (sweeps, model presets), with one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.errors import KvbenchError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: Path, what: str) -> dict[str, object]:
    """The TOML table in path; `what` names the file in errors ("sweep file", "preset")."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise KvbenchError(f"cannot read {what} {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise KvbenchError(f"{what} {path} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise KvbenchError(f"{what} {path} is not a text file") from None
