"""YAML pipelines on Spark: sources -> transforms -> sinks (``headwater pipeline run``)."""

from .spec import PipelineError, PipelineSpec, load_pipeline

__all__ = ["PipelineError", "PipelineSpec", "load_pipeline"]
