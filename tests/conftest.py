"""8 simulated CPU devices for every test, set before JAX initializes."""

from maxpar.tools.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)
