"""adapt: bring giant Mixture-of-Experts models up on a new accelerator, gate by gate."""

__version__ = "0.1.0"
