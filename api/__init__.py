"""HTTP API and command line of Swallow."""
