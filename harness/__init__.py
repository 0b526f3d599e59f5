"""The harness tests and benchmarks share: private stacks and Redis topologies (not shipped)."""
