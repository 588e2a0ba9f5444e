"""The trainer's glibc malloc policy on XLA:CPU (maxpar.host.malloc): when it applies, and what it sets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maxpar.host import malloc


class FakeLibc:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


APPLIED, KEPT_OUT, SILENT = "applied", "kept out by the user's variable", None


@pytest.mark.parametrize("enabled, platform, env, glibc, outcome", [
    (True, "cpu", {}, True, APPLIED),
    (False, "cpu", {}, True, SILENT),
    (True, "gpu", {}, True, SILENT),
    (True, "tpu", {}, True, SILENT),
    (True, "cpu", {}, False, SILENT),                                            # musl, macOS: no glibc mallopt
    (True, "cpu", {"MALLOC_TOP_PAD_": "0"}, True, KEPT_OUT),                      # the user's own setting stands
    (True, "cpu", {"MALLOC_TRIM_THRESHOLD_": "1"}, True, KEPT_OUT),
    (True, "cpu", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, True, KEPT_OUT),
    (True, "cpu", {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, True, APPLIED),  # not a malloc tunable
    (True, "cpu", {"MALLOC_ARENA_MAX": "2"}, True, APPLIED),                      # a setting it does not touch
])
def test_it_applies_only_on_xla_cpu_with_glibc_and_never_over_the_users_settings(monkeypatch, enabled, platform,
                                                                                  env, glibc, outcome):
    monkeypatch.setattr(malloc, "on_glibc", lambda: glibc)
    fake = FakeLibc()
    note = malloc.tune(enabled, platform, env, fake)
    if outcome is APPLIED:  # the three settings, and the run's log says so
        assert dict(fake.calls) == {malloc.M_MMAP_THRESHOLD: 32 << 20, malloc.M_TRIM_THRESHOLD: 1 << 30,
                                    malloc.M_TOP_PAD: 64 << 20}
        assert "keeps each step's freed buffers mapped" in note
        assert "on by default; set cpu_malloc_tuning=false for glibc's defaults" in note  # the default, not theirs
    else:
        assert fake.calls == []
    if outcome is KEPT_OUT:  # the log names the user's variable
        assert next(iter(env)) in note and "not applied" in note
    if outcome is SILENT:
        assert note is None


def test_a_refused_setting_is_an_error_that_names_it():
    with pytest.raises(OSError, match=str(malloc.M_TOP_PAD)):
        malloc.apply(FakeLibc(refuse={malloc.M_TOP_PAD}))


@pytest.mark.skipif(not malloc.on_glibc(), reason="glibc only")
def test_glibc_accepts_the_settings_in_a_fresh_process():
    # A fresh interpreter: the settings are process-wide, and this test process should keep glibc's defaults.
    script = "from maxpar.host import malloc; print(malloc.tune(True, 'cpu', {}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "keeps each step's freed buffers mapped" in done.stdout
