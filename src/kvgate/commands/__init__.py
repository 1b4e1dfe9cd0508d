"""Command-line shells: argument parsing, files, clocks and printing around the pure parts."""
