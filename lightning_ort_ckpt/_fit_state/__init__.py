"""Where a fit stands beside its weights: random states, the data position, what a resumed fit restores when
training starts."""
