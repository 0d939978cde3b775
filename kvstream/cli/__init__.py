"""The ``kvstream`` command line (layer L4): thin wiring over the library."""
