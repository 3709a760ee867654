"""`pitstop replay`: an operator's own failure history priced with and without pitstop."""
