"""Parameter shardings of the preset strategies match the checked-in golden file."""

from __future__ import annotations

import copy

from maxpar.tools import shardings_dump


def test_shardings_match_golden():
    lines = shardings_dump.check()
    assert not lines, ("parameter shardings changed:\n  " + "\n  ".join(lines) +
                       "\nIf this change is intended, regenerate the golden file with "
                       "`python -m maxpar.tools.shardings_dump --update` and review the diff of tests/goldens/shardings.json.")


def test_diff_names_the_changed_parameter():
    golden = {"s": {"mesh": {"fsdp": 8}, "params": {"w": {"shape": [8], "logical": ["embed"], "mesh": ["fsdp"]}}}}
    changed = copy.deepcopy(golden)
    changed["s"]["params"]["w"]["mesh"] = [None]
    assert shardings_dump.diff(golden, golden) == []
    assert shardings_dump.diff(golden, changed) == ["s: w: mesh ['fsdp'] -> [None]"]
