"""maxpar: a config-driven LLM trainer for JAX.

Every entry point (train, generate, plan, convert, tools, the end_to_end scripts) imports this package before JAX
starts a backend, so this is the one place that keeps libtpu's start-up warnings out of CPU-only machines."""
from maxpar.host.devices import cpu_unless_accelerators

cpu_unless_accelerators()
