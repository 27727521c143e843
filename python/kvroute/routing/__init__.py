"""How a worker is chosen: the policies, and the tokenization that turns a request into
the token IDs the prefix index is keyed by."""
