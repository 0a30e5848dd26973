"""Recovery from failures: the fast tier, promotion to the persistent one, peer copies, and saves asked for by
signals."""
