"""Generation: prefill, decode, the jitted loops, sampling, streaming, compiled executables, processes. It sees methods only through the protocol in core.kv (docs/design.md §2)."""
