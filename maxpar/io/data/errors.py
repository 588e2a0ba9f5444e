"""Read errors of every data source as one line naming the file and the position in it.

A shard can be damaged past what opening it checks (a Parquet data page behind an intact footer, a
later ArrayRecord chunk) or vanish during a run, so a document can fail to read at any step. Each
source reads under `reading`, which turns the reader's own exception (OSError, ArrowInvalid, a
Riegeli RuntimeError, ...) into a `DataError`: the trainer prints it and exits with status 2, like a
config error, instead of a reader's traceback.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from maxpar.core.config import ConfigError


class DataError(ConfigError):
    """A document that cannot be read; the message names the source, the file and where in it."""


def one_line(error: BaseException) -> str:
    """`Type: message` on one line: readers' messages span lines and may hold control characters."""
    message = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", str(error)).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@contextlib.contextmanager
def reading(source: str, where: str) -> Iterator[None]:
    """Any failure inside is a DataError `SOURCE: cannot read WHERE: cause`; a ConfigError about the
    record's content (a missing field, not JSON) passes unchanged."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # each reader has its own kinds; all mean the same to a run
        raise DataError(f"{source}: cannot read {where}: {one_line(e)}") from e
