"""The faults tier imports its harness by module name, like tests/distributed does."""
