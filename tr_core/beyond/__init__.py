"""Methods beyond the paper: drafts from the context (``suffix``, ``tr-context``, ``tr-plus``) and the
best-first tree from the matrix's probabilities (``tr-dynamic``)."""
