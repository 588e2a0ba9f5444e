"""The contract of every end-to-end script: the last line says PASS or FAIL, and FAIL exits non-zero.

A script's `main()` prints its own PASS/FAIL line and returns the exit status; `exit_with(main)`
keeps the contract when `main` crashes instead (a traceback alone is not a verdict a reader or
`run_all.sh` log can grep for).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_with(main: Callable[[], int]) -> NoReturn:
    """sys.exit(main()), with a crash reported as a final `FAIL: ...` line and exit status 1."""
    try:
        status = main()
    except Exception as e:  # noqa: BLE001 - any crash is a failed check, reported as such
        traceback.print_exc()
        sys.stderr.flush()
        print(f"FAIL: crashed with {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    sys.exit(status)
