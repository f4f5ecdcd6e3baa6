"""Results across budgets and methods: sweeps to CSV (``sweep``), timelines and Chrome traces of
one schedule (``timeline``), figures (``plots``, matplotlib, imported only to draw)."""
