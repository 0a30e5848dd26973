"""Which checkpoints are kept and when a save is ranked: pure rules and what the callback protects."""
