"""The HTTP service: the ASGI app and its fast path, forwarding, upstream connection
pools, admission control, errors rendered in OpenAI's shape, metrics and the status page."""
