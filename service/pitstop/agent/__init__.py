"""The host agent: one per host, root; captures, sends, receives and restores workers."""
