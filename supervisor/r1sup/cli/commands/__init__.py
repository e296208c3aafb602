"""One module per CLI command, each with ``main(args) -> int``; imported only when the command runs."""
