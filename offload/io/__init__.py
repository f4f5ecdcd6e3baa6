"""Files and text, for every command and both sides of torch: reading and validating JSON
documents and writing every output by one rule (``files``, ``validate``), human units both
ways and what the terminal is shown (``text``), and the command line's argument types
(``argtypes``).  Torch-free; depends only on ``offload.errors``."""
