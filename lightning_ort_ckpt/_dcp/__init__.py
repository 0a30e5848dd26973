"""The DCP wing: sharded checkpoints as folders of per-rank ODTC files, and what the plugin does under sharded
strategies."""
