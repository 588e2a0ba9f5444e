"""The trainer's glibc malloc policy on XLA:CPU (maxpar.tools.host_malloc): when it applies, and what it sets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maxpar.tools import host_malloc


class FakeLibc:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


@pytest.mark.parametrize("enabled, platform, env, libc, applied", [
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
def test_it_applies_only_on_xla_cpu_with_glibc_and_never_over_the_users_settings(monkeypatch, enabled, platform,
                                                                                  env, libc, applied):
    monkeypatch.setattr(host_malloc, "libc_name", lambda: libc)
    fake = FakeLibc()
    note = host_malloc.tune(enabled, platform, env, fake)
    if applied:  # the three settings, and the run's log says so
        assert dict(fake.calls) == {host_malloc.M_MMAP_THRESHOLD: 32 << 20, host_malloc.M_TRIM_THRESHOLD: 1 << 30,
                                    host_malloc.M_TOP_PAD: 64 << 20}
        assert "keeps each step's freed buffers mapped" in note
    else:
        assert fake.calls == []
    kept_out_by_user = enabled and platform == "cpu" and libc == "glibc" and not applied
    assert (note is not None) == (applied or kept_out_by_user)
    if kept_out_by_user:  # the log names the user's variable
        assert next(iter(env)) in note and "not applied" in note


def test_a_refused_setting_is_an_error_that_names_it():
    with pytest.raises(OSError, match=str(host_malloc.M_TOP_PAD)):
        host_malloc.apply(FakeLibc(refuse={host_malloc.M_TOP_PAD}))


@pytest.mark.skipif(host_malloc.libc_name() != "glibc", reason="glibc only")
def test_glibc_accepts_the_settings_in_a_fresh_process():
    # A fresh interpreter: the settings are process-wide, and this test process should keep glibc's defaults.
    script = "from maxpar.tools import host_malloc; print(host_malloc.tune(True, 'cpu', {}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "keeps each step's freed buffers mapped" in done.stdout
