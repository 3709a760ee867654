"""Worker networks: an address per worker that moves with it (see workerns.py)."""
