"""How data is laid out, framework-free and communication-free: the gradients' bucket plan
(``buckets``), their formats on the wire (``compression``) and every rank's share of the
samples (``sampler``). Nothing here imports the rest of core."""
