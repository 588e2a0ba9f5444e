"""The trainer's glibc malloc policy on XLA:CPU (maxpar.tools.host_malloc): when it applies, and what it sets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maxpar.tools import host_malloc


@pytest.mark.parametrize("enabled, platform, env, libc, expected", [
    (True, "cpu", {}, "glibc", True),
    (False, "cpu", {}, "glibc", False),
    (True, "gpu", {}, "glibc", False),
    (True, "tpu", {}, "glibc", False),
    (True, "cpu", {}, "", False),                                            # musl, macOS: no glibc mallopt
    (True, "cpu", {"MALLOC_TOP_PAD_": "0"}, "glibc", False),                  # the user's own setting stands
    (True, "cpu", {"MALLOC_TRIM_THRESHOLD_": "1"}, "glibc", False),
    (True, "cpu", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "glibc", False),
    (True, "cpu", {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, "glibc", True),  # not a malloc tunable
    (True, "cpu", {"MALLOC_ARENA_MAX": "2"}, "glibc", True),                  # a setting it does not touch
])
def test_it_applies_only_on_xla_cpu_with_glibc_and_never_over_the_users_settings(enabled, platform, env, libc,
                                                                                  expected):
    assert host_malloc.should_tune(enabled, platform, env, libc) is expected


class FakeLibc:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


def test_it_sets_the_mmap_threshold_trim_threshold_and_top_pad():
    libc = FakeLibc()
    host_malloc.apply(libc)
    assert dict(libc.calls) == {host_malloc.M_MMAP_THRESHOLD: 32 << 20, host_malloc.M_TRIM_THRESHOLD: 1 << 30,
                                host_malloc.M_TOP_PAD: 64 << 20}


def test_a_refused_setting_is_an_error_that_names_it():
    with pytest.raises(OSError, match=str(host_malloc.M_TOP_PAD)):
        host_malloc.apply(FakeLibc(refuse={host_malloc.M_TOP_PAD}))


def test_the_log_line_says_what_was_done_and_why_not():
    assert host_malloc.tune(True, "gpu", {}) is None
    assert host_malloc.tune(False, "cpu", {}) is None
    note = host_malloc.tune(True, "cpu", {"MALLOC_TOP_PAD_": "0"})
    assert "MALLOC_TOP_PAD_" in note and "not applied" in note


@pytest.mark.skipif(host_malloc.libc_name() != "glibc", reason="glibc only")
def test_glibc_accepts_the_settings_in_a_fresh_process():
    # A fresh interpreter: the settings are process-wide, and this test process should keep glibc's defaults.
    script = "from maxpar.tools import host_malloc; print(host_malloc.tune(True, 'cpu', {}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "keeps each step's freed buffers mapped" in done.stdout
