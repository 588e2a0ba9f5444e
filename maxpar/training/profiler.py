"""`profiler=xplane`: a `jax.profiler` trace of a window of training steps under RUN/profile/.

The trace (an XPlane `.xplane.pb` for TensorBoard's profile plugin / XProf, plus a Perfetto
`perfetto_trace.json.gz`) covers steps profiler_start_step .. profiler_start_step + profiler_steps - 1.
The window starts late enough to skip the first step's warm-up when the defaults are kept, and the
trace stops only after the last traced step's results exist, so its device work is inside the trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from maxpar.core import storage
from maxpar.core.config import Config

PROFILE_SUBDIR = "profile"


def profile_window(config: Config) -> range:
    """The steps to trace (empty when profiling is off)."""
    if not config.profiler:
        return range(0)
    return range(config.profiler_start_step, config.profiler_start_step + config.profiler_steps)


class StepProfiler:
    """Starts a trace before the first step of the window and stops it after the last one.

    A run resumed inside the window traces its remaining steps; one resumed after it traces none.
    """

    def __init__(self, window: range, run_dir: epath.PathLike, log: Callable[[str], None] = lambda _: None):
        self._window = window
        self._log = log
        self._first_traced: int | None = None
        self._directory = storage.path(run_dir) / PROFILE_SUBDIR
        self._mirror: storage.LocalMirror | None = None  # the trace is written locally; a gs:// run's copied up at stop
        self._active = False
        self._annotation: Any = None  # the open step's StepTraceAnnotation (step markers in the trace viewer)

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def before_step(self, step: int) -> None:
        if step in self._window and not self._active:
            self._mirror = storage.LocalMirror(self._directory)
            self._mirror.directory.mkdir(parents=True, exist_ok=True)
            # every process writes its own <host>.xplane.pb; the Perfetto file has one name, so process 0 writes it
            jax.profiler.start_trace(str(self._mirror.directory), create_perfetto_trace=jax.process_index() == 0)
            self._active = True
            self._first_traced = step
        if self._active:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def after_step(self, step: int, outputs: Any) -> None:
        """`outputs`: the step's results, waited for so its device work lands inside the trace."""
        if not self._active:
            return
        jax.block_until_ready(outputs)
        self._end_annotation()
        if step >= self._window[-1]:
            self.stop()
            self._log(f"  profile: trace of steps {self._first_traced}-{step} in {self._directory} "
                      f"(tensorboard --logdir {self._directory}, or perfetto_trace.json.gz in ui.perfetto.dev)")

    def _end_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def stop(self) -> None:
        """Ends an open trace (also when a step raises inside the window)."""
        self._end_annotation()
        if self._active:
            self._active = False
            jax.profiler.stop_trace()
            self._mirror.close()
