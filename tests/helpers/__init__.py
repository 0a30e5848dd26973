"""What several test modules share: models, fits, child processes, servers and reference checks. No test module
imports another; they import from here (docs/testing.md)."""
