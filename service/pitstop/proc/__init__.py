"""Reading live processes through /proc: a worker's tree, its windows of memory, the files and
capabilities it holds.  Used by every layer above; knows nothing of CRIU or of the network."""
