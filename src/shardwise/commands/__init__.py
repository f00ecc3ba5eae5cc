"""One module per CLI verb; each defines ``register(app)``. Modules must not import torch at top level."""
