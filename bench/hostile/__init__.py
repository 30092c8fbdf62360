"""Attacks against a live stack and what a normal tenant saw meanwhile: the probe's first attacks and what the
others share (`attacks`), hostile image files (`files`, `images`, `cost`), connections and routes held (`holds`,
`routes`), padding, a GPU flood, cache hits and stuck DNS. Imports the stack, meters and load wings."""
