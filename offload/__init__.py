"""The ``offload`` command: assembles the subcommands of each stage package."""
