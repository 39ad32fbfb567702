"""Stage 6 measurement tools: load generation, soak sampling, server probes, timers, ceilings, provenance."""
