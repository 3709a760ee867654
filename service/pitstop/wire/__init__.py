"""The contract between pitstop's services: the clients each side uses to call the other, the
heartbeat codec, and the bearer header.  Imported by both services; imports neither."""
