"""The development stack: the services started as real processes on loopback, the scenario that drives them,
and the simulated cluster that benchmarks and tests share. Above services and engines; below bench and the CLI."""
