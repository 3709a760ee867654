"""Streaming images between agents, pipelined with the dump."""
