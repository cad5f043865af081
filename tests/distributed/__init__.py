"""Distributed tests: optkit on DTensor / FSDP2 parameters, gloo backend on CPU, 2 processes spawned here."""
