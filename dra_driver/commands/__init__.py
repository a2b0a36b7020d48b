"""The `dra-driver` subcommands, one module each."""
