"""Pipeline stages as Triton models: the `stages` executor that calls them (BLS or an
ensemble), one stage's worker and its Triton model, and the repository writer
(`python -m orca_backend.serving.stages.repository`)."""
