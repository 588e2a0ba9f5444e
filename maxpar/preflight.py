"""Checks a run makes before any device work, so that a mistake costs seconds and gives a clear message.

Each raises ConfigError (exit status 2) naming the key, the value and what would work.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from maxpar.config import Config, ConfigError


def check_output_directory(config: Config) -> None:
    """base_output_directory (and the run's directory when it exists) must be a directory this process can write.

    Checked by writing a file rather than with os.access, which says yes to root on a read-only file
    system; an unwritable directory otherwise surfaces as a PermissionError deep inside the first save.
    """
    key, value = "base_output_directory", config.base_output_directory
    base = Path(value).expanduser()
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}={value!r}: cannot create it ({e.strerror or e}); choose a directory you can "
                          f"write") from None
    run_dir = base / config.run_name if config.run_name else base
    directory = run_dir if run_dir.is_dir() else base
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".maxpar-write-check-"):
            pass
    except OSError as e:
        where = "" if directory == base else f" (the run directory {directory})"
        raise ConfigError(f"{key}={value!r}{where}: cannot write there ({e.strerror or e}); choose a directory you "
                          f"can write") from None
