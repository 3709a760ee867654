"""Driving CRIU: which CRIU runs (runtime, probe), dumping and restoring over its RPC (swrk,
criu_ops), the network lock, its log quoted with context, and the seal on a dump's files."""
