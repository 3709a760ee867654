"""A worker's memory between pauses: dirty-page tracking and deltas for pre-copy, CRIU's
incremental dump, and the rules and views of network post-copy."""
