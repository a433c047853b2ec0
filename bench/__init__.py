"""The benchmarks: scripts run as ``python bench/<name>.py`` (each writes under bench/results/<name>/), and
bench/lib, what they share. A script puts the repository on sys.path and imports ``bench.lib.<module>``."""
