"""`pitstop run`: start a command so that it can be captured, and keep standing in for it."""
