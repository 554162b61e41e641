"""What we compare against: request-level batching as Triton users deploy it today, Triton's
dynamic batcher in front of `transformers` `generate` (`hf_dynamic_batching`)."""
