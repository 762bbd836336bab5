"""Sidecars: receive an inference server's KV traffic and write chunk records into Redis."""
