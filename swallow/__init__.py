"""The `swallow` command: the serving commands (``api``), the demo's
(``demo``) and the benchmarks (``bench``) on one command line. It sits above
every other package, so none of them need import another to be reached."""
