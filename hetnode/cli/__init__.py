"""Command line: argument parsing, logging set-up and exit codes. Subcommands live one per module."""
