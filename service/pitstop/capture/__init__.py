"""Capturing and restoring process trees: CRIU through pycriu, image layout, integrity."""
