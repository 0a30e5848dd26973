"""How one save of the plugin runs: what it writes, where it runs (inline or on a background thread), and the staged
copies an asynchronous save writes from."""
