"""The local-cluster harness (the demo, benchmarks and tests): real agents and a coordinator on
one machine, hosts as network namespaces.  Nothing in the product imports it."""
