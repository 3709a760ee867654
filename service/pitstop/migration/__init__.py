"""Moving workers between agents: the step sequence and its rollback rules."""
