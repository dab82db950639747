"""Test tooling that tests and benchmarks share (imported by neither the CLI nor a build)."""
