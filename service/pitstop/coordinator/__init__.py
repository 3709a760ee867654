"""The coordinator: the one part that knows the cluster; plans and drives evacuations."""
