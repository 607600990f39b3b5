"""The defaults of a `--from URL` download's budgets, in a module of their own that imports nothing: the
CLI's parser shows them in `--help` without loading torch (`hetnode/export/source.py` applies them)."""

DEFAULT_TIMEOUT_S = 3600.0  # the whole download: the 3.9 GB `1b` checkpoint at 1.1 MB/s
DEFAULT_MAX_BYTES = 4096 << 20  # room for the `1b` checkpoint (3.7 GiB), never the disk
