"""Clients for the ORCA Triton model: a streaming CLI and a small helper library."""
