"""The tools around the two daemons: ``fl-demo`` (a whole federation on this machine),
``fl-sim`` (many edges in a few processes), ``fl-report`` (plots and summaries of a run's
history). Tools may import both daemon packages; the daemons never import a tool."""
